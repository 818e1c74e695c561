"""Response regeneration (self-distillation): rewrite assistant turns with the target itself.

Each conversation is replayed turn by turn: the target answers user turn 1 from the (system and) user
prompt, its own answer becomes the history of user turn 2, and so on, so every answer is written
with the target's own history, as serving would. Conversations are processed in batches; within a
batch, turn t of every conversation that has one is generated in one backend call.

Resumable: finished conversations are appended to an OpenAI-style `messages` JSONL (one line per
conversation, keyed by `id`, flushed and fsynced per batch). A rerun reads the ids already written
(dropping and counting a torn last line left by a kill) and skips them. The output is a valid
`data.path`. Its sidecar <output>.manifest (data/manifest.py, written atomically) records the
settings, whether the run finished and then the file's size and sha256: the data readers refuse an
unfinished, cut or altered output, and a rerun with other settings is refused rather than mixed in.

A backend is any object whose `generate(conversations)` returns one `Generation` per conversation
(message lists ending with a user turn); `prompt_texts` and `decode_answer` render a prompt and read
an answer the same way for every backend that tokenises here. The backends live next to the
engines they drive: `decoding/hf_backend.py` `HFBackend` (an in-process transformers model; CPU
works), `serving/backends.py` `VllmBackend` (vLLM's offline engine in its own environment, token ids
in and out, one engine for the whole run) and `EndpointBackend` (any OpenAI-compatible
/v1/chat/completions server: vLLM, SGLang); `peagle regenerate` (cli/regenerate.py) picks one.
Several engines at once (one vLLM engine per GPU, each on its shard of the conversations, merged
into this same output): data/regenerate_shards.py.

As the field regenerates (speculators' and SpecForge's data scripts, EAGLE's self-distillation):
- Answers are sampled with the target's recommended parameters (`target_sampling`: the temperature,
  top_p and top_k its generation_config sets, as vLLM and SGLang read them; greedy when it sets
  none), each overridable. Conversation `id`'s turn t draws with its own seed
  (`turn_seed(seed, id, t)`), so an answer does not depend on the batch it fell in and a resumed
  run writes what an uninterrupted one would (up to floating-point differences between batches).
- Every assistant turn is rewritten, on the regenerated history (above).
- A conversation with an answer cut at max_new_tokens is dropped whole (counted), as speculators
  and SpecForge drop such samples: a cut answer teaches the head a stop that the target never makes.
- Exact duplicates are counted: answers equal to one already in the output (kept: short answers
  legitimately repeat), and whole conversations equal to one already in the output (dropped).
Dropped conversations are recorded in the sidecar <output>.dropped (one {"id", "reason"} line
each, appended per batch), so a rerun skips them too; the manifest counts them by reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..io import atomic_write_json

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generated answer: text, and whether it stopped at the token limit. too_long: the prompt
    did not fit the target's context, so nothing was generated (text "")."""

    text: str
    cut: bool = False
    too_long: bool = False


def prompt_texts(tok, conversations: list[list[dict]], template_kwargs: dict) -> list[str]:
    """Each conversation in the chat template with a generation prompt (what the target answers)."""
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **template_kwargs)
            for c in conversations]


def decode_answer(tok, eos: set[int], row: list[int]) -> Generation:
    """The answer in generated token ids `row`: decoded up to the first eos id; cut when there is none."""
    stop = next((i for i, t in enumerate(row) if t in eos), None)
    ids = row if stop is None else row[:stop]
    return Generation(tok.decode(ids, skip_special_tokens=True).strip(), cut=stop is None)


def as_list(x) -> list:
    """None, one id or a list of ids (a generation config's eos_token_id) as a list."""
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])


@dataclass(frozen=True)
class Sampling:
    """How answers are drawn. temperature 0 = greedy (top_p and top_k unused); top_p 1.0 and top_k 0
    are off. seed: the run's seed (`turn_seed`). source: where each value came from (the user, the
    target's generation_config, or the greedy default)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    source: str = "greedy (default)"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def as_dict(self) -> dict:
        return asdict(self)


SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def target_sampling(generation_config, *, temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, seed: int = 0) -> Sampling:
    """The sampling of a regeneration: the user's values where given, else the target's.

    generation_config: the target's transformers `GenerationConfig` (model.generation_config, or
    `GenerationConfig.from_pretrained`), or None when it has none. Its values are those its file
    sets (`to_diff_dict()`: what differs from transformers' defaults), as vLLM and SGLang read a
    model's recommended parameters: temperature (1.0 when it sets only do_sample=True, greedy when
    it sets neither), top_p (1.0 when unset), top_k (0 = off when unset).
    """
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    diff = generation_config.to_diff_dict() if generation_config is not None else {}
    own = {k: diff[k] for k in SAMPLING_KEYS if diff.get(k) is not None}
    if "temperature" not in own and diff.get("do_sample"):
        own["temperature"] = 1.0
    vals = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    src = {}
    for k in SAMPLING_KEYS:
        if given[k] is not None:
            vals[k], src[k] = given[k], "user"
        elif k in own:
            vals[k], src[k] = own[k], "target generation_config"
    if not src:
        source = "greedy (the target's generation_config sets no sampling)"
    else:
        source = "; ".join(f"{', '.join(k for k in SAMPLING_KEYS if src.get(k) == w)} from the {w}"
                           for w in ("user", "target generation_config") if w in src.values())
    return Sampling(float(vals["temperature"]), float(vals["top_p"]), int(vals["top_k"] or 0), int(seed), source)


def turn_seed(seed: int, cid: str, turn: int) -> int:
    """The seed of conversation `cid`'s assistant turn `turn` (0-based) in a run seeded `seed`: the
    first 31 bits of sha256("seed/cid/turn"), an int in [0, 2**31) every backend accepts."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{cid}/{turn}".encode()).digest()[:4], "big") & 0x7FFFFFFF


@dataclass
class RegenerateStats:
    """Counts of a regeneration run. cut_at_max_new_tokens: answers that hit the token limit (their
    conversations are dropped when drop_cut); duplicate_answers: answers written equal to one
    already in the output; duplicate_conversations: conversations equal to one already in the
    output (dropped); prompts_over_context: turns not asked because their prompt (the history so
    far) does not fit the target's context, which ends the conversation before that turn;
    dropped: conversations not written, by reason (this run)."""

    skipped_done: int = 0
    skipped_dropped: int = 0
    written: int = 0
    turns_generated: int = 0
    cut_at_max_new_tokens: int = 0
    stopped_at_empty_answer: int = 0
    prompts_over_context: int = 0
    turns_cut_by_max_turns: int = 0
    torn_lines_dropped: int = 0
    duplicate_answers: int = 0
    duplicate_conversations: int = 0
    dropped: dict = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


CUT = "an answer cut at max_new_tokens"
OVER_CONTEXT = "first prompt longer than the target's context"
DUPLICATE = "exact duplicate of a conversation in the output"


def dropped_path(out_path: str | Path) -> Path:
    """The sidecar of a regeneration output listing its dropped conversations: <file>.dropped."""
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".dropped")


def read_dropped(out_path: str | Path) -> dict[str, str]:
    """{id: reason} of the conversations a run on `out_path` dropped (`dropped_path`); {} without
    one. A torn last line (a kill mid-write) is cut off the file: its conversation is redone."""
    path = dropped_path(out_path)
    fix = "remove that line (its conversation is regenerated), then rerun"
    return {str(r["id"]): r["reason"] for r in _complete_lines(path, "a dropped conversation", fix, ("id", "reason"))[0]}


def _digest(obj) -> bytes:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()).digest()[:16]


class _Seen:
    """Digests of the answers and conversations in the output, to count exact duplicates."""

    def __init__(self, out_path: Path):
        self.answers, self.conversations, self.file_duplicate_answers = set(), set(), 0
        if out_path.is_file():
            with open(out_path, encoding="utf-8") as f:  # line by line: the output may hold 500k conversations
                for line in f:
                    if line.strip():
                        self.file_duplicate_answers += self.add(json.loads(line)["messages"])

    def is_duplicate(self, msgs: list[dict]) -> bool:
        return _digest(msgs) in self.conversations

    def add(self, msgs: list[dict]) -> int:
        """Record a written conversation; returns how many of its answers were already in the output."""
        self.conversations.add(_digest(msgs))
        dup = 0
        for m in msgs:
            if m["role"] == "assistant":
                d = _digest(m["content"])
                dup += d in self.answers
                self.answers.add(d)
        return dup


def _complete_lines(path: Path, what: str, fix: str, keys: tuple[str, ...]) -> tuple[list[dict], bool]:
    """(The JSON lines of `path`, each reduced to `keys`; whether a torn last line was cut): ([], False)
    without the file. A torn last line (a kill mid-write: no newline) is cut off the file and logged.

    Raises:
        CorruptFileError: a complete line that is not `what` (bad JSON, a key missing), naming the
            file, the line and `fix`."""
    from ..errors import CorruptFileError

    if not path.is_file():
        return [], False
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
        logger.warning(f"{path}: its last line was cut off ({len(data) - end} bytes without a newline: a run "
                       "stopped while writing it); dropped, its conversation is regenerated")
    records = []
    for n, line in enumerate(data[:end].split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            records.append({k: r[k] for k in keys})
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptFileError(f"{path}, line {n}: not {what} ({type(e).__name__}: {str(e)[:120]}): the file is "
                                   f"damaged. Fix: {fix}.") from e
    return records, end < len(data)


def done_ids(out_path: Path, stats: RegenerateStats | None = None, fix: str = "") -> set[str]:
    """Ids already in the output JSONL. A torn last line (a kill mid-write) is cut off the file,
    logged and counted in `stats.torn_lines_dropped`.

    Raises:
        CorruptFileError: a complete line that is not a conversation with an id (a damaged file),
            naming the file, the line and `fix`.
    """
    records, torn = _complete_lines(out_path, "a regenerated conversation",
                                    fix or "remove that line (or the file), then rerun", ("id",))
    if torn and stats is not None:
        stats.torn_lines_dropped += 1
    return {str(r["id"]) for r in records}


def _check_resumable(out_path: Path, manifest: dict | None, settings: dict | None, fix: str) -> None:
    """Refuse to continue an output made with other settings (answers of two kinds in one file), or
    one altered after its run finished. A cut one is continued (its missing conversations are
    regenerated)."""
    from ..errors import CorruptFileError
    from ..provenance import sha256_file
    from .manifest import regenerated_manifest_path

    if manifest is None or not out_path.is_file():
        return
    where = regenerated_manifest_path(out_path)
    old = manifest.get("settings")
    if settings is not None and old is not None and old != settings:
        diff = ", ".join(f"{k}: {old.get(k)!r} then, {settings.get(k)!r} now" for k in sorted(set(old) | set(settings))
                         if old.get(k) != settings.get(k))
        raise CorruptFileError(f"{out_path}: written by peagle regenerate with other settings ({diff}; {where}); "
                               "continuing it would mix two kinds of answers in one file. Fix: choose another "
                               f"regenerate.output, or remove {out_path} and {where.name} to start over.")
    size = out_path.stat().st_size
    if manifest["complete"] and size > manifest["bytes"] or (
            size == manifest["bytes"] and manifest.get("sha256") and sha256_file(out_path) != manifest["sha256"]):
        other = "another sha256" if size == manifest["bytes"] else f"{size} bytes"
        raise CorruptFileError(f"{out_path}: altered after peagle regenerate finished it ({where} records "
                               f"{manifest['bytes']} bytes and their sha256, the file holds {other}). Fix: remove "
                               f"{out_path} and {where.name}, then {fix}.")
    if manifest["complete"] and size < manifest["bytes"]:
        logger.warning(f"{out_path}: {size} bytes, {where} records {manifest['bytes']} (cut off): continuing from its "
                       "complete lines; the conversations lost are regenerated")


def regenerate(conversations, backend, out_path: str | Path, *, batch_size: int = 16,
               extra: dict | None = None, max_turns: int | None = None, settings: dict | None = None,
               command: str | None = None, seed: int = 0, drop_cut: bool = True,
               desc: str = "regenerating") -> RegenerateStats:
    """Rewrite the assistant turns of `conversations` with `backend`; append them to `out_path`.

    conversations: iterable of (id, messages) with normalised messages (user/assistant alternating,
    optional leading system). Conversations whose id is already in out_path, or in its
    <out_path>.dropped, are skipped.
    extra: fields added to every written line (e.g. {"regenerated_by": "<model>"}).
    max_turns: answer at most this many user turns per conversation (the rest is cut, counted as
    "turns cut by max_turns"); None = all.
    seed: the run's seed; the backend draws conversation id's turn t with `turn_seed(seed, id, t)`.
    drop_cut: drop a conversation with an answer cut at the backend's max_new_tokens (counted; the
    field's choice, module docstring); False keeps it, its cut answer in the history of the next turn.
    An empty answer ends its conversation there (counted), as does a prompt longer than the
    target's context (counted; the turn is not asked); a conversation left without an answer
    is not written (counted); one equal to a conversation already in the output is dropped (counted).
    settings: what the answers depend on (backend, model, sampling); a rerun with other settings is
    refused. command: the command line that continues the run, named in the errors of its readers.
    The sidecar <out_path>.manifest says "not finished" from before the first line is appended until
    the last batch is written, then records the file's size and sha256 (module docstring).
    desc: the progress bar's label (one bar per shard under data/regenerate_shards.py).

    Raises:
        CorruptFileError: out_path or its manifest is damaged, altered, or was written with other
            settings (naming the file and the fix).
    """
    from .manifest import read_regenerated_manifest, regenerate_fix, regenerated_manifest_path

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    stats = RegenerateStats()
    fix = regenerate_fix(out_path, command)
    _check_resumable(out_path, read_regenerated_manifest(out_path), settings, fix)
    done = done_ids(out_path, stats, fix=f"remove that line (or the file) and {fix}")
    dropped_before = read_dropped(out_path)
    seen = _Seen(out_path)
    manifest = {"what": "peagle regenerate output", "file": out_path.name, "settings": settings, "command": command,
                "complete": False, "conversations": len(done), "bytes": out_path.stat().st_size if out_path.is_file() else 0,
                "sha256": None}
    atomic_write_json(regenerated_manifest_path(out_path), manifest)
    todo = []
    for cid, msgs in conversations:
        if str(cid) in done:
            stats.skipped_done += 1
        elif str(cid) in dropped_before:
            stats.skipped_dropped += 1
        else:
            todo.append((str(cid), _first_turns(msgs, max_turns, stats)))
    if stats.skipped_done or stats.skipped_dropped:
        logger.info(f"{out_path}: {stats.skipped_done} conversations already regenerated and "
                    f"{stats.skipped_dropped} already dropped ({dropped_path(out_path).name}), skipped")
    with open(out_path, "a", encoding="utf-8") as f, open(dropped_path(out_path), "a", encoding="utf-8") as fd, \
            tqdm(total=len(todo), desc=desc, unit="conv") as bar:
        for b in range(0, len(todo), batch_size):
            batch = todo[b: b + batch_size]
            lines, gone = [], []
            for cid, msgs, reason in _regenerate_batch(batch, backend, stats, seed, drop_cut):
                if reason is None and seen.is_duplicate(msgs):
                    reason = DUPLICATE
                    stats.duplicate_conversations += 1
                if reason is not None:
                    stats.drop(reason)
                    gone.append(json.dumps({"id": cid, "reason": reason}, ensure_ascii=False) + "\n")
                    continue
                stats.duplicate_answers += seen.add(msgs)
                lines.append(_json_line(cid, msgs, extra))
            for handle, text in ((fd, gone), (f, lines)):  # the dropped first: a kill between keeps both right
                handle.write("".join(text))
                handle.flush()
                os.fsync(handle.fileno())
            stats.written += len(lines)
            bar.update(len(batch))
    _finish(out_path, {**manifest, "conversations": len(done) + stats.written},
            seen.file_duplicate_answers + stats.duplicate_answers)
    return stats


def _finish(out_path: Path, manifest: dict, duplicate_answers: int) -> None:
    """Write the manifest of a finished run: complete, the file's size and sha256, and the whole
    output's counts (dropped conversations by reason, from <out_path>.dropped; duplicate answers)."""
    from ..provenance import sha256_file
    from .manifest import regenerated_manifest_path

    dropped = {}
    for reason in read_dropped(out_path).values():
        dropped[reason] = dropped.get(reason, 0) + 1
    atomic_write_json(regenerated_manifest_path(out_path), {
        **manifest, "complete": True, "bytes": out_path.stat().st_size, "sha256": sha256_file(out_path),
        "dropped": dropped, "duplicate_answers": duplicate_answers,
        "duplicate_conversations_dropped": dropped.get(DUPLICATE, 0), "cut_answers_dropped": dropped.get(CUT, 0)},
        durable=True)


def _first_turns(msgs: list[dict], max_turns: int | None, stats: RegenerateStats) -> list[dict]:
    """msgs up to (not including) the user turn number max_turns + 1; the cut turns are counted."""
    if not max_turns:
        return msgs
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(users) <= max_turns:
        return msgs
    stats.turns_cut_by_max_turns += len(users) - max_turns
    return msgs[: users[max_turns]]


def _json_line(cid: str, msgs: list[dict], extra: dict | None) -> str:
    return json.dumps({"id": cid, "messages": msgs, **(extra or {})}, ensure_ascii=False) + "\n"


def _regenerate_batch(batch, backend, stats: RegenerateStats, seed: int = 0, drop_cut: bool = True):
    """Turn-by-turn regeneration of one batch: yields (id, new messages, None) of the conversations
    kept and (id, None, reason) of those dropped (reason: CUT, OVER_CONTEXT or "no answer
    generated"). Turn t of conversation id is drawn with `turn_seed(seed, id, t)`. A turn whose
    prompt the backend finds longer than the target's context (`Generation.too_long`) is not
    generated: its conversation ends with the turns before it."""
    # per conversation: the new history so far, and the queue of remaining original messages
    state = []
    for cid, msgs in batch:
        hist, rest = [], list(msgs)
        while rest and rest[0]["role"] != "assistant":
            hist.append(rest.pop(0))
        state.append({"id": cid, "hist": hist, "rest": rest, "turn": 0, "cut": False,
                      "open": bool(rest) and hist and hist[-1]["role"] == "user"})
    while True:
        active = [s for s in state if s["open"]]
        if not active:
            break
        gens = backend.generate([s["hist"] for s in active], seeds=[turn_seed(seed, s["id"], s["turn"]) for s in active])
        for s, g in zip(active, gens):
            if g.too_long:  # the conversation ends before this turn; with no answer yet it is dropped
                stats.prompts_over_context += 1
                s["open"], s["over_context"] = False, True
                continue
            stats.turns_generated += 1
            stats.cut_at_max_new_tokens += g.cut
            s["turn"] += 1
            s["rest"].pop(0)  # the original assistant turn, replaced
            if not g.text:
                stats.stopped_at_empty_answer += 1
                s["open"] = False
                continue
            s["hist"].append({"role": "assistant", "content": g.text})
            if g.cut and drop_cut:  # dropped at the end of the batch: no later turn is asked
                s["cut"], s["open"] = True, False
                continue
            users = []
            while s["rest"] and s["rest"][0]["role"] != "assistant":
                users.append(s["rest"].pop(0))
            s["hist"] += users
            s["open"] = bool(s["rest"]) and bool(users)
    for s in state:
        if s["cut"]:
            yield s["id"], None, CUT
            continue
        while s["hist"] and s["hist"][-1]["role"] != "assistant":
            s["hist"].pop()
        if any(m["role"] == "assistant" for m in s["hist"]):
            yield s["id"], s["hist"], None
        else:
            yield s["id"], None, OVER_CONTEXT if s.get("over_context") else "no answer generated"
