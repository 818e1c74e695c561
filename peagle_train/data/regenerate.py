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

Backends: `HFBackend` (an in-process transformers model; CPU works), `VllmBackend` (vLLM's offline
engine in its own environment, token ids in and out, one engine for the whole run) and
`EndpointBackend` (any OpenAI-compatible /v1/chat/completions server: vLLM, SGLang).
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..io import atomic_write_json

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generated answer: text, and whether it stopped at the token limit."""

    text: str
    cut: bool = False


class HFBackend:
    """Greedy (temperature 0) or sampled generation with an in-process HF causal LM. Greedy batches
    use shared forwards with finished rows leaving the batch (`decoding.engine`; HF `generate`
    runs a batch until its longest answer); sampling uses
    HF `generate` with left padding. The prompt is the tokenizer's chat template with
    add_generation_prompt=True."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 512, temperature: float = 0.0,
                 template_kwargs: dict | None = None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.template_kwargs = dict(template_kwargs or {})
        self.eos = {self.tok.eos_token_id} | set(_as_list(getattr(self.model.generation_config, "eos_token_id", None)))
        self.eos.discard(None)
        self._target = None

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]]) -> list[Generation]:
        """conversations: message lists ending with a user turn. Returns one Generation each."""
        texts = _prompt_texts(self.tok, conversations, self.template_kwargs)
        if self.temperature <= 0:
            from ..decoding.engine import generate
            from ..target.capture import FeatureTarget

            if self._target is None:
                self._target = FeatureTarget(self.model)
            prompts = self.tok(texts, add_special_tokens=False)["input_ids"]
            res = generate(self._target, None, prompts, 0, self.max_new_tokens, self.eos)
            return [self._answer(r.tokens) for r in res]
        side, self.tok.padding_side = self.tok.padding_side, "left"
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        try:
            enc = self.tok(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(self.model.device)
        finally:
            self.tok.padding_side = side
        sample = self.temperature > 0
        out = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=sample, pad_token_id=pad,
                                  **({"temperature": self.temperature, "top_p": 1.0} if sample else {}))
        return [self._answer(row) for row in out[:, enc["input_ids"].shape[1]:].tolist()]

    def _answer(self, row: list[int]) -> Generation:
        return _answer(self.tok, self.eos, row)


def _prompt_texts(tok, conversations: list[list[dict]], template_kwargs: dict) -> list[str]:
    """Each conversation in the chat template with a generation prompt (what the target answers)."""
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **template_kwargs)
            for c in conversations]


def _answer(tok, eos: set[int], row: list[int]) -> Generation:
    """The answer in generated token ids `row`: decoded up to the first eos id; cut when there is none."""
    stop = next((i for i, t in enumerate(row) if t in eos), None)
    ids = row if stop is None else row[:stop]
    return Generation(tok.decode(ids, skip_special_tokens=True).strip(), cut=stop is None)


def _as_list(x):
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])


class VllmBackend:
    """Generation by vLLM's offline engine in its own environment (peagle_train/serving/vllm_engine.py
    `VllmSession`): the prompt is rendered and tokenised here exactly as `HFBackend` does (chat
    template with add_generation_prompt=True, template_kwargs), vLLM generates from those token
    ids, and the answer is decoded here. The engine starts on the first call and stops at `close`;
    `max_num_seqs` sequences decode together (the regeneration batch: `regenerate.batch_size`)."""

    def __init__(self, target_dir: str, tokenizer, eos: set[int], *, python: str, log_path: Path,
                 max_new_tokens: int = 512, temperature: float = 0.0, template_kwargs: dict | None = None,
                 dtype: str = "bfloat16", max_model_len: int = 4096, threads: int | None = None, seed: int = 0,
                 max_num_seqs: int = 16):
        self.tok, self.eos = tokenizer, set(eos)
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.template_kwargs = dict(template_kwargs or {})
        self._args = dict(target_dir=target_dir, python=python, log_path=log_path, dtype=dtype,
                          max_model_len=max_model_len, threads=threads, max_num_seqs=max_num_seqs)
        self._session = None
        self.generated_tokens = 0

    def generate(self, conversations: list[list[dict]]) -> list[Generation]:
        """conversations: message lists ending with a user turn. Returns one Generation each."""
        from ..serving.vllm_engine import VllmSession

        if self._session is None:
            self._session = VllmSession(**self._args)
        texts = _prompt_texts(self.tok, conversations, self.template_kwargs)
        prompts = self.tok(texts, add_special_tokens=False)["input_ids"]
        outs = self._session.generate(prompts, max_new_tokens=self.max_new_tokens, stop_token_ids=self.eos,
                                      temperature=self.temperature, seed=self.seed)
        self.generated_tokens += sum(len(o["token_ids"]) for o in outs)
        return [_answer(self.tok, self.eos, o["token_ids"]) for o in outs]

    def summary(self) -> dict:
        """vLLM's version, engine start seconds, generate seconds and generated tokens so far."""
        s = self._session
        return {"vllm_version": s.info.get("vllm_version") if s else None,
                "load_seconds": s.info.get("load_seconds") if s else None,
                "generate_seconds": s.generate_seconds if s else 0.0, "generated_tokens": self.generated_tokens}

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class EndpointError(UserError, RuntimeError):
    """The regeneration endpoint cannot be reached or gives no answer (names the URL and the fix)."""


class EndpointBackend:
    """POST /v1/chat/completions of an OpenAI-compatible server, `concurrency` requests at a time.

    Raises:
        EndpointError (a RuntimeError and a user error: one line at the command line): the server
            cannot be reached or answers without a choice (names the URL).
    """

    def __init__(self, base_url: str, model: str, *, max_new_tokens: int = 512, temperature: float = 0.0,
                 concurrency: int = 8, timeout_s: float = 600.0, api_key: str | None = None,
                 template_kwargs: dict | None = None):
        self.url = base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.model, self.max_new_tokens, self.temperature = model, max_new_tokens, temperature
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self.template_kwargs = dict(template_kwargs or {})

    def _one(self, messages: list[dict]) -> Generation:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens,
                "temperature": self.temperature}
        if self.template_kwargs:  # vLLM / SGLang: arguments of the chat template, e.g. enable_thinking
            body["chat_template_kwargs"] = self.template_kwargs
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                ans = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise EndpointError(f"Endpoint {self.url} failed: {e}. Fix: check regenerate.endpoint_url and that "
                               "the server is up (vllm serve / sglang).") from e
        try:
            choice = ans["choices"][0]
            return Generation((choice["message"].get("content") or "").strip(), choice.get("finish_reason") == "length")
        except (KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"Endpoint {self.url} answered without choices[0].message: {str(ans)[:200]}. Fix: "
                                "point regenerate.endpoint_url at an OpenAI-compatible server (vllm serve / sglang).") from e

    def generate(self, conversations: list[list[dict]]) -> list[Generation]:
        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as ex:
            return list(ex.map(self._one, conversations))


@dataclass
class RegenerateStats:
    """Counts of a regeneration run."""

    skipped_done: int = 0
    written: int = 0
    turns_generated: int = 0
    cut_at_max_new_tokens: int = 0
    stopped_at_empty_answer: int = 0
    turns_cut_by_max_turns: int = 0
    torn_lines_dropped: int = 0
    dropped: dict = field(default_factory=dict)


def done_ids(out_path: Path, stats: RegenerateStats | None = None, fix: str = "") -> set[str]:
    """Ids already in the output JSONL. A torn last line (a kill mid-write) is cut off the file,
    logged and counted in `stats.torn_lines_dropped`.

    Raises:
        CorruptFileError: a complete line that is not a conversation with an id (a damaged file),
            naming the file, the line and `fix`.
    """
    from ..errors import CorruptFileError

    if not out_path.is_file():
        return set()
    data = out_path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(out_path, "r+b") as f:
            f.truncate(end)
        logger.warning(f"{out_path}: its last line was cut off ({len(data) - end} bytes without a newline: a run "
                       "stopped while writing it); dropped, its conversation is regenerated")
        if stats is not None:
            stats.torn_lines_dropped += 1
    ids = set()
    for n, line in enumerate(data[:end].split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptFileError(f"{out_path}, line {n}: not a regenerated conversation ({type(e).__name__}: "
                                   f"{str(e)[:120]}): the file is damaged. Fix: {fix or 'remove that line (or the file), then rerun'}."
                                   ) from e
    return ids


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


def backend_from_config(rcfg, target_cfg, data_cfg, precision: str = "auto"):
    """(backend, tokenizer or None) of the `regenerate` config group: `hf` loads the target of
    target.path in-process (with data.chat_template); `endpoint` talks to regenerate.endpoint_url
    serving regenerate.model. Both render with data.template_kwargs and use regenerate.max_new_tokens
    and temperature; `vllm` runs vLLM on target.path in its own environment, in `precision` (auto:
    bf16 where the hardware has it). Raises ConfigError for another backend."""
    from omegaconf import OmegaConf

    from ..errors import ConfigError

    kw = OmegaConf.to_container(data_cfg.template_kwargs) if OmegaConf.is_config(data_cfg.template_kwargs) \
        else data_cfg.template_kwargs
    kw = kw or None
    if rcfg.backend == "hf":
        from ..target.load import load_target
        from .template import set_chat_template

        model, tok = load_target(target_cfg.path)
        set_chat_template(tok, data_cfg.chat_template)
        return HFBackend(model, tok, max_new_tokens=rcfg.max_new_tokens, temperature=rcfg.temperature,
                         template_kwargs=kw), tok
    if rcfg.backend == "vllm":
        from transformers import AutoTokenizer

        from ..serving.vllm_engine import vllm_dtype, vllm_python
        from ..target.load import load_target_config, model_source
        from .template import set_chat_template

        src = model_source(target_cfg.path)
        tok = AutoTokenizer.from_pretrained(src)
        set_chat_template(tok, data_cfg.chat_template)
        gen_cfg = Path(src, "generation_config.json")
        eos = {tok.eos_token_id} | set(_as_list(json.loads(gen_cfg.read_text()).get("eos_token_id")
                                                if gen_cfg.is_file() else None))
        eos.discard(None)
        ctx = getattr(load_target_config(target_cfg.path), "max_position_embeddings", 4096)
        return VllmBackend(src, tok, eos, dtype=vllm_dtype(precision), python=vllm_python(rcfg.get("vllm_python")),
                           log_path=Path(str(rcfg.output)).parent / "vllm_regenerate.log",
                           max_new_tokens=rcfg.max_new_tokens, temperature=rcfg.temperature, template_kwargs=kw,
                           max_model_len=min(int(ctx), 8192), max_num_seqs=rcfg.batch_size), tok
    if rcfg.backend == "endpoint":
        return EndpointBackend(rcfg.endpoint_url, rcfg.model, max_new_tokens=rcfg.max_new_tokens,
                               temperature=rcfg.temperature, concurrency=rcfg.concurrency, template_kwargs=kw), None
    raise ConfigError(f"regenerate.backend={rcfg.backend!r}: use hf, vllm or endpoint")


def regenerate(conversations, backend, out_path: str | Path, *, batch_size: int = 16,
               extra: dict | None = None, max_turns: int | None = None, settings: dict | None = None,
               command: str | None = None) -> RegenerateStats:
    """Rewrite the assistant turns of `conversations` with `backend`; append them to `out_path`.

    conversations: iterable of (id, messages) with normalised messages (user/assistant alternating,
    optional leading system). Conversations whose id is already in out_path are skipped.
    extra: fields added to every written line (e.g. {"regenerated_by": "<model>"}).
    max_turns: answer at most this many user turns per conversation (the rest is cut, counted as
    "turns cut by max_turns"); None = all.
    An empty answer ends its conversation there (counted); a conversation left without an answer
    is not written (counted).
    settings: what the answers depend on (backend, model, sampling); a rerun with other settings is
    refused. command: the command line that continues the run, named in the errors of its readers.
    The sidecar <out_path>.manifest says "not finished" from before the first line is appended until
    the last batch is written, then records the file's size and sha256 (module docstring).

    Raises:
        CorruptFileError: out_path or its manifest is damaged, altered, or was written with other
            settings (naming the file and the fix).
    """
    from ..provenance import sha256_file
    from .manifest import read_regenerated_manifest, regenerate_fix, regenerated_manifest_path

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    stats = RegenerateStats()
    fix = regenerate_fix(out_path, command)
    _check_resumable(out_path, read_regenerated_manifest(out_path), settings, fix)
    done = done_ids(out_path, stats, fix=f"remove that line (or the file) and {fix}")
    manifest = {"what": "peagle regenerate output", "file": out_path.name, "settings": settings, "command": command,
                "complete": False, "conversations": len(done), "bytes": out_path.stat().st_size if out_path.is_file() else 0,
                "sha256": None}
    atomic_write_json(regenerated_manifest_path(out_path), manifest)
    todo = []
    for cid, msgs in conversations:
        if str(cid) in done:
            stats.skipped_done += 1
        else:
            todo.append((str(cid), _first_turns(msgs, max_turns, stats)))
    if stats.skipped_done:
        logger.info(f"{out_path}: {stats.skipped_done} conversations already regenerated, skipped")
    with open(out_path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc="regenerating", unit="conv") as bar:
        for b in range(0, len(todo), batch_size):
            batch = todo[b: b + batch_size]
            lines = [_json_line(cid, msgs, extra) for cid, msgs in _regenerate_batch(batch, backend, stats)]
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            stats.written += len(lines)
            bar.update(len(batch))
    atomic_write_json(regenerated_manifest_path(out_path), {
        **manifest, "complete": True, "conversations": len(done) + stats.written,
        "bytes": out_path.stat().st_size, "sha256": sha256_file(out_path)}, durable=True)
    return stats


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


def _regenerate_batch(batch, backend, stats: RegenerateStats):
    """Turn-by-turn regeneration of one batch: yields (id, new messages) of the conversations kept."""
    # per conversation: the new history so far, and the queue of remaining original messages
    state = []
    for cid, msgs in batch:
        hist, rest = [], list(msgs)
        while rest and rest[0]["role"] != "assistant":
            hist.append(rest.pop(0))
        state.append({"id": cid, "hist": hist, "rest": rest, "open": bool(rest) and hist and hist[-1]["role"] == "user"})
    while True:
        active = [s for s in state if s["open"]]
        if not active:
            break
        gens = backend.generate([s["hist"] for s in active])
        for s, g in zip(active, gens):
            stats.turns_generated += 1
            stats.cut_at_max_new_tokens += g.cut
            s["rest"].pop(0)  # the original assistant turn, replaced
            if not g.text:
                stats.stopped_at_empty_answer += 1
                s["open"] = False
                continue
            s["hist"].append({"role": "assistant", "content": g.text})
            users = []
            while s["rest"] and s["rest"][0]["role"] != "assistant":
                users.append(s["rest"].pop(0))
            s["hist"] += users
            s["open"] = bool(s["rest"]) and bool(users)
    for s in state:
        while s["hist"] and s["hist"][-1]["role"] != "assistant":
            s["hist"].pop()
        if any(m["role"] == "assistant" for m in s["hist"]):
            yield s["id"], s["hist"]
        else:
            stats.dropped["no answer generated"] = stats.dropped.get("no answer generated", 0) + 1
