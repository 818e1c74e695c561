"""The GPU check (docs/TRAINING.md "The GPU check"): two parts, each one command of at most 7 minutes
on one GPU, each printing one JSON line per step on stdout and into OUT/part<N>.jsonl as the step
ends, so that what was measured stays when a later step dies. Run through scripts/gpu_check.sh,
which first installs the carried wheelhouse (gpu_wheels/) into the image's Python:

    python scripts/gpu_check.py part 1 --out DIR     # versions, cuda_tests, step8b
    python scripts/gpu_check.py part 2 --out DIR     # groups, engines, cpu_vs_gpu, eval8b
    python scripts/gpu_check.py part 1 --out DIR --device cpu --config tiny/config.json   # the CPU rehearsal

Each step runs in its own process under a limit (`PARTS`); past it the step gets SIGINT (pytest
then prints its counts), then SIGKILL, and its JSON line says `timed_out`. pytest counts come from
the `-v` lines, so a killed run keeps the tests it finished. A part never runs past `PART_LIMIT_S`:
a step gets at most what is left of it.

The steps, by hand:

    python scripts/gpu_check.py versions
    python scripts/gpu_check.py step8b --tokens 2048,8192,16384      # an 8B-shaped training step
    python scripts/gpu_check.py eval8b --prompts 4 --new-tokens 64     # decoding ms/token on it
    python scripts/gpu_check.py groups --minutes 0.2                   # every NCCL group's timeout under ZeRO

step8b builds Llama-3.1-8B's architecture (the config.json shipped with the recipes, or the HF
cache's) with random weights in bf16 on the GPU, and the recipe's 4-layer head on it; it trains 3
steps (online features, bf16 autocast, FlexAttention, partitions 2, the recipe's anchors) per row
length and reports tokens/s of the last 2 steps, the peak of torch's allocator against the
planner's estimate (`training/memory.py`), and the block mask's compiled builds in the process so far
(`algorithms/cod.py:block_mask_build_counts`: one builder, a few compiles however many row lengths).
Each row length starts with the previous one's head, engine and optimizer freed (`_free_for_measure`).
eval8b decodes a few random prompts with that target and head, with SDPA over a bf16 KV cache (how
CUDA decodes) and again with the fp32 attention over an fp32 cache (how it decoded before), and
extrapolates the recipe's evaluation time (num_prompts × max_new_tokens) of each against NCCL's
10-minute default timeout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = "llama-3.1-8b-instruct"
DEVICE = "cuda"   # --device cpu with --config tiny.json: the rehearsal of the check on a CPU machine
CONFIG = None     # --config: a config.json instead of the recipe target's
PART_LIMIT_S = 400  # one part, its steps together: inside one 10-minute command with the wheels' install
KILL_GRACE_S = 15   # after SIGINT at a step's limit, before SIGKILL
CPU_SLACK = 2.0     # the rehearsal's limits, part and steps, are this many times the GPU's: it checks
                    # packages and APIs on a 2-core CPU (DeepSpeed's CPU backend compiles its shared-memory
                    # op on first use there), not the GPU's time

# (name, limit in seconds, kind, arguments on a GPU, arguments in the CPU rehearsal)
PARTS = {
    1: [("versions", 30, "py", ["versions"], ["versions"]),
        ("cuda_tests", 150, "pytest", ["tests/integration/test_cuda.py", "-k", "not each_engine and not cpu_and_gpu"], None),
        ("step8b", 210, "py", ["step8b", "--tokens", "2048,8192,16384"], ["step8b", "--tokens", "128,256"])],
    2: [("groups", 40, "py", ["groups"], ["groups"]),
        ("engines", 150, "pytest", ["tests/integration/test_cuda.py", "-k", "each_engine"], None),
        ("cpu_vs_gpu", 50, "pytest", ["tests/integration/test_cuda.py", "-k", "cpu_and_gpu"], None),
        ("eval8b", 150, "py", ["eval8b", "--prompts", "4", "--new-tokens", "64"],
         ["eval8b", "--prompts", "2", "--new-tokens", "16"])],
}
PYTEST_OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


def emit(step: str, **kw) -> dict:
    """Print one JSON line {"step": step, **kw} (flushed) and return it as a dict."""
    rec = {"step": step, **kw}
    print(json.dumps(rec, default=str), flush=True)
    return rec


def package_names() -> list[str]:
    """The distributions the check reports: the GPU image's (scripts/gpu_image.txt) and the carried
    wheelhouse's (scripts/gpu_wheels.txt), by name, in file order."""
    names = []
    for f in ("gpu_image.txt", "gpu_wheels.txt"):
        for line in (REPO / "scripts" / f).read_text().splitlines():
            name = re.split(r"[=<>!~ #]", line.strip(), maxsplit=1)[0]
            if name and name not in names:
                names.append(name)
    return names


def versions() -> None:
    """One line: torch, CUDA, NCCL, the GPU, and the installed version of every package the check
    names (None when absent). ok: CUDA is present (or the rehearsal's --device cpu) and every
    carried package imports."""
    from importlib import metadata

    pkgs = {}
    for name in package_names():
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    failed = {}
    for mod in ("transformers", "accelerate", "datasets", "hydra", "omegaconf", "deepspeed", "gguf", "peagle_train"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001 - reported, the step fails
            failed[mod] = f"{type(e).__name__}: {e}"[:300]
    dev = {}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        dev = {"gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
               "bf16": torch.cuda.is_bf16_supported(), "devices": torch.cuda.device_count(),
               "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    emit("versions", ok=(torch.cuda.is_available() or DEVICE == "cpu") and not failed, device=DEVICE,
         python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda, **dev,
         import_errors=failed, packages=pkgs)


def recipe_cfg():
    from hydra import compose, initialize_config_dir

    from peagle_train.config import register
    from peagle_train.paths import CONF_DIR

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=[f"recipe={RECIPE}"])


def target_config(cfg):
    """The recipe target's config.json (`plan.target_config`: the HF cache's, else the one shipped
    with the recipes), or --config's."""
    from transformers import AutoConfig

    from peagle_train.plan import target_config as recipe_target_config

    if CONFIG:
        return AutoConfig.from_pretrained(CONFIG)
    return recipe_target_config(cfg.target)[0]


def build_8b(cfg):
    """(FeatureTarget of a random-weight bf16 target of the recipe's architecture, draft, vocab)."""
    from transformers import AutoModelForCausalLM

    from peagle_train.data.vocab import DraftVocab
    from peagle_train.jobs.builders import build_draft
    from peagle_train.target.capture import FeatureTarget

    tcfg = target_config(cfg)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.bfloat16).eval().requires_grad_(False)
    target = FeatureTarget(model)
    V = tcfg.vocab_size
    Vd = min(cfg.data.draft_vocab_size, V - 1)
    vocab = DraftVocab.from_ids(torch.arange(Vd), V)
    draft = build_draft(target, cfg.draft, vocab, V - 1, str(cfg.algorithm))
    return target, draft, vocab, tcfg


def planner_estimate(tcfg, draft_config, cfg, tokens: int) -> dict | None:
    try:
        from peagle_train.training.memory import estimate_step_memory

        # the step as step8b runs it: one row (grad_accum 1), the recipe's partitions, FlexAttention, online
        est = estimate_step_memory(tcfg, draft_config, tokens=tokens, max_anchors=cfg.training.max_anchors,
                                   num_depths=cfg.draft.num_depths, world_size=1, engine="ddp", grad_accum=1,
                                   partitions=cfg.training.partitions, attention="flex", online=True,
                                   mask_compiled=DEVICE == "cuda")
        return {k: round(v / 2**30, 2) for k, v in est.items() if isinstance(v, (int, float)) and not k.startswith("elements")}
    except Exception as e:  # noqa: BLE001 - the measurement stands without it
        return {"error": f"{type(e).__name__}: {e}"}


def _free_for_measure() -> None:
    """Free what the previous row length left (its head, engine, optimizer: collected once nothing
    refers to them) and start the allocator's peak from here."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _step8b_case(cfg, target, vocab, tcfg, state: dict, tokens: int, params: tuple[int, int]) -> dict:
    """One row length of step8b: a fresh head holding `state` (host tensors), 3 training steps of 4
    random rows of `tokens` tokens, the record of its line. Returns plain values only: the head,
    its engine and optimizer are unreachable when it returns."""
    import shutil

    import datasets
    import torch._dynamo.utils as dyn
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from peagle_train.algorithms.cod import block_mask_build_counts
    from peagle_train.jobs.builders import build_draft
    from peagle_train.training.checks import TrainSettings
    from peagle_train.training.trainer import train

    draft = build_draft(target, cfg.draft, vocab, tcfg.vocab_size - 1, str(cfg.algorithm))
    draft.load_state_dict(state, strict=False)
    draft_config = draft.config
    g = torch.Generator().manual_seed(tokens)
    rows = datasets.Dataset.from_dict({
        "input_ids": [torch.randint(0, tcfg.vocab_size - 1, (tokens,), generator=g).tolist() for _ in range(4)],
        "loss_mask": [[0] * 64 + [1] * (tokens - 64) for _ in range(4)]})
    tc = TrainSettings.from_config(
        cfg, precision="bf16",
        training=OmegaConf.merge(cfg.training, {"tokens_per_step": tokens, "max_steps": 3, "epochs": 1,
                                                "warmup_steps": 1, "grad_accum": 1, "save_every": None,
                                                "val_conversations": 0, "tracker": "none"}),
        distributed=OmegaConf.merge(cfg.distributed, {"engine": "ddp"}))
    out = Path(f"/tmp/gpu_check_step8b_{tokens}")
    shutil.rmtree(out, ignore_errors=True)
    _free_for_measure()
    before = sum(dyn.counters["stats"].values()) if "stats" in dyn.counters else 0
    t0 = time.perf_counter()
    try:
        res = train(Accelerator(cpu=DEVICE == "cpu"), draft.to(DEVICE), target, rows, vocab.draft_ids, tc, out)
        del draft
        log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
        steps = [r for r in log if "loss" in r]
        elapsed = [r["tokens"] / r["tokens_per_second"] for r in steps]  # seconds since the loop started
        warm = ((steps[-1]["tokens"] - steps[0]["tokens"]) / (elapsed[-1] - elapsed[0])) if len(steps) > 1 else None
        return dict(ok=True, tokens=tokens, device=DEVICE, head_params=params[0], head_trainable=params[1],
                    seconds=round(time.perf_counter() - t0, 1), tokens_per_s_all=round(res["tokens_per_second"]),
                    tokens_per_s_after_first=round(warm) if warm else None,
                    losses=[round(r["loss"], 4) for r in steps], peak_gib=round(peak, 2) if peak is not None else None,
                    planner_gib=planner_estimate(tcfg, draft_config, cfg, tokens),
                    dynamo_stats=dict(dyn.counters.get("stats", {})),
                    dynamo_delta=(sum(dyn.counters["stats"].values()) if "stats" in dyn.counters else 0) - before,
                    block_mask=block_mask_build_counts())
    except torch.cuda.OutOfMemoryError as e:
        return dict(ok=False, tokens=tokens, error=f"OOM: {str(e)[:300]}",
                    planner_gib=planner_estimate(tcfg, draft_config, cfg, tokens))
    except Exception as e:  # noqa: BLE001
        return dict(ok=False, tokens=tokens, device=DEVICE, error=f"{type(e).__name__}: {e}",
                    trace=traceback.format_exc()[-1500:])


def step8b(tokens_list: list[int]) -> None:
    """One line per row length (`_step8b_case`); the target stays, each head is freed before the
    next length's peak is measured."""
    cfg = recipe_cfg()
    try:
        target, draft0, vocab, tcfg = build_8b(cfg)
    except Exception as e:  # noqa: BLE001
        emit("step8b", ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-1500:])
        return
    params = (sum(p.numel() for p in draft0.parameters()), sum(p.numel() for p in draft0.parameters() if p.requires_grad))
    state = {k: v.detach().to("cpu", copy=True) for k, v in draft0.state_dict().items()}  # on the host, not counted
    del draft0
    for tokens in tokens_list:
        emit("step8b", **_step8b_case(cfg, target, vocab, tcfg, state, tokens, params))


def eval8b(n_prompts: int, new_tokens: int) -> None:
    """Decode with the target's attention as CUDA decoding runs it (SDPA over a bf16 KV cache), then
    with the fp32 `decode_attention` over an fp32 cache that it ran before (`sdpa_decoding=False`),
    the same prompts: ms/token, τ and lossless of each, and the recipe's evaluation extrapolated."""
    import shutil

    from peagle_train.evaluation.run import evaluate_acceptance
    from peagle_train.evaluation.settings import EvalSettings

    cfg = recipe_cfg()
    target, draft, vocab, tcfg = build_8b(cfg)
    draft = draft.to(DEVICE).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [{"id": i, "category": "random", "input_ids": torch.randint(0, tcfg.vocab_size - 1, (200,),
                                                                         generator=g).tolist()}
               for i in range(n_prompts)]
    settings = EvalSettings(num_speculative_tokens=cfg.eval.num_speculative_tokens, max_new_tokens=new_tokens,
                            plot=False, benchmark="random")
    prec = "bf16" if DEVICE == "cuda" else "fp32"  # an fp32 target has one path: its own SDPA
    runs = [(f"sdpa, {prec} KV cache", None)] + ([("fp32 decode_attention, fp32 KV cache", False)] if prec == "bf16" else [])
    for attention, sdpa in runs:
        target.sdpa_decoding = sdpa
        out = Path(f"/tmp/gpu_check_eval8b_{'fp32' if sdpa is False else 'sdpa'}")
        shutil.rmtree(out, ignore_errors=True)  # a resumed evaluation would reuse its results and time nothing
        t0 = time.perf_counter()
        acc = evaluate_acceptance(target, draft, None, prompts, settings, out_dir=out, precision=prec)
        wall = time.perf_counter() - t0
        made = n_prompts * new_tokens
        ms_per_token = 1000 * wall / made  # target alone + head, as the recipe's evaluation decodes both
        n_eval = cfg.eval.num_prompts or 80
        recipe_minutes = ms_per_token * n_eval * cfg.eval.max_new_tokens / 60000
        emit("eval8b", ok=True, attention=attention, prompts=n_prompts, new_tokens=new_tokens, wall_s=round(wall, 1),
             ms_per_token=round(ms_per_token, 2), tau=acc.get("acceptance_length"), lossless=acc.get("lossless"),
             recipe_eval_minutes=round(recipe_minutes, 1), nccl_default_timeout_minutes=10,
             would_outlive_default_timeout=recipe_minutes > 10,
             note="the process group is released before rank 0 evaluates (jobs/training_job.py end_distributed)")
    target.sdpa_decoding = None


# ------------------------------------------------------------------------------------ the parts
def pytest_counts(log: str) -> dict[str, int]:
    """{outcome: count} of a `pytest -v` log, from its per-test lines ("path::test[id] PASSED [ 50%]"),
    so that a run killed before its summary keeps the tests it finished. Outcomes: PYTEST_OUTCOMES."""
    counts = dict.fromkeys(PYTEST_OUTCOMES, 0)
    for m in re.finditer(r"^\S+::\S+.*? (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", log, re.M):
        word = m.group(1).lower()
        counts[{"xfail": "xfailed", "xpass": "xpassed"}.get(word, word)] += 1
    return counts


def _sigint_default() -> None:
    """In the step's process before it starts: SIGINT back to its default action. A check started as a
    shell's background job (`... &`, nohup) inherits SIGINT ignored, and a step would then sit out the
    whole grace and be killed without its summary."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_limited(cmd: list[str], limit: float, log_path: Path, env: dict) -> tuple[int, bool, float]:
    """Run `cmd` (its stdout and stderr into `log_path`) for at most `limit` seconds: then SIGINT to
    its process group, SIGKILL after KILL_GRACE_S. Returns (exit status, timed out, seconds)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True,
                             preexec_fn=_sigint_default)
        timed_out = False
        try:
            rc = p.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGINT)
            try:
                rc = p.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
    return rc, timed_out, time.perf_counter() - t0


def run_step(name: str, limit: float, kind: str, args: list[str], out: Path, device: str, config: str | None,
             record) -> bool:
    """One step of a part in its own process: its JSON lines go through `record`; returns whether it
    passed. A pytest step's line: ok, exit, seconds, timed_out and the counts of its -v lines (kept
    when it is killed); a Python step's: its own lines, plus one saying why when it ended otherwise."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if device == "cpu":
        env["PEAGLE_CHECK_DEVICE"] = "cpu"
    log = out / f"{name}.log"
    if kind == "pytest":
        cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *args]
        rc, timed_out, secs = run_limited(cmd, limit, log, env)
        counts = pytest_counts(log.read_text(errors="replace"))
        ok = rc == 0 and not timed_out and counts["failed"] == 0 and counts["error"] == 0
        record(emit(name, ok=ok, exit=rc, seconds=round(secs, 1), timed_out=timed_out, **counts, log=str(log)))
        return ok
    cmd = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), *args, "--device", device,
           *(["--config", config] if config else [])]
    rc, timed_out, secs = run_limited(cmd, limit, log, env)
    lines = [json.loads(x) for x in log.read_text(errors="replace").splitlines() if x.startswith('{"step"')]
    for rec in lines:
        record(emit(**rec))
    ok = rc == 0 and not timed_out and bool(lines) and all(r.get("ok") for r in lines)
    if rc != 0 or timed_out or not lines:
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip() and not x.startswith("{")][-1:]
        record(emit(name, ok=False, exit=rc, seconds=round(secs, 1), timed_out=timed_out,
                    last_error=(tail[0][-300:] if tail else None), log=str(log)))
    return ok


def run_part(part: int, out: Path, device: str = "cuda", config: str | None = None,
             part_limit: float = PART_LIMIT_S) -> bool:
    """Part 1 or 2 of the check (`PARTS`): each step's lines printed and appended to
    out/part<N>.jsonl as it ends, then a summary line. On a GPU every step runs; in the rehearsal
    (`device` cpu) each with its rehearsal arguments, pytest steps on CPU where a test can
    (tests/integration/test_cuda.py, PEAGLE_CHECK_DEVICE=cpu), every limit times CPU_SLACK. No step starts
    past `part_limit`."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"part{part}.jsonl"
    jsonl.write_text("")

    def record(rec: dict) -> None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")

    t0, failed = time.perf_counter(), []
    slack = 1.0 if device == "cuda" else CPU_SLACK
    part_limit *= slack
    for name, limit, kind, gpu_args, cpu_args in PARTS[part]:
        args = gpu_args if device == "cuda" or cpu_args is None else cpu_args
        limit *= slack
        left = part_limit - (time.perf_counter() - t0)
        if left < 5:
            record(emit(name, ok=False, skipped=True, error=f"no time left in part {part}'s {part_limit:.0f} s"))
            failed.append(name)
            continue
        if not run_step(name, min(limit, left), kind, args, out, device, config, record):
            failed.append(name)
    record(emit("summary", part=part, ok=not failed, failed_steps=failed, device=device,
                seconds=round(time.perf_counter() - t0, 1), results=str(jsonl)))
    return not failed


def groups(minutes: float) -> None:
    """A DeepSpeed ZeRO-2 engine (training/engines.py `make_engine`, timeout_minutes=`minutes`) on a
    world of 1 made as Accelerate makes it on GPUs (backend nccl, timeout `minutes`; gloo with
    --device cpu), one step, then the timeout of every process group's NCCL (gloo) backend: all must
    be `minutes` (before engines.default_group_timeout, DeepSpeed's world clone had NCCL's 10 min)."""
    import os
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from peagle_train.training.engines import make_engine

    os.environ.setdefault("LOCAL_RANK", "0")
    dev = torch.device(DEVICE)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(minutes=minutes))
    head = torch.nn.Linear(64, 64).to(dev)
    eng = make_engine("deepspeed", 2, head, torch.optim.AdamW(head.parameters()),
                      SimpleNamespace(num_processes=1, device=dev), 1, None, timeout_minutes=minutes)
    eng.backward(eng.model(torch.randn(4, 64, device=dev)).square().mean())
    eng.step()
    got = [pg._get_backend(dev).options._timeout.total_seconds() for pg in c10d._world.pg_map]
    emit("groups", ok=len(got) >= 2 and all(t == 60 * minutes for t in got), timeouts_s=got, want_s=60 * minutes,
         backend=dist.get_backend())
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["part", "versions", "step8b", "eval8b", "groups"])
    ap.add_argument("part", nargs="?", type=int, choices=[1, 2], help="with `part`: which one")
    ap.add_argument("--out", default="/tmp/gpu_check", help="with `part`: where its lines and logs go")
    ap.add_argument("--minutes", type=float, default=0.2, help="groups: the process-group timeout set")
    ap.add_argument("--tokens", default="2048,8192,16384")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda", help="cpu: the rehearsal of the check (with --config)")
    ap.add_argument("--config", default=None, help="a config.json to build instead of the recipe target's")
    a = ap.parse_args()
    global DEVICE, CONFIG
    DEVICE, CONFIG = a.device, a.config
    if a.what == "part":
        if a.part is None:
            ap.error("part: say which, 1 or 2")
        if a.device == "cuda" and not torch.cuda.is_available():
            emit("summary", part=a.part, ok=False, error="no CUDA device: the GPU steps did not run. Fix: run it on "
                 "the GPU machine, or rehearse on CPU with bash scripts/gpu_check.sh --rehearse")
            sys.exit(2)
        sys.exit(0 if run_part(a.part, Path(a.out), a.device, a.config) else 1)
    if a.what == "versions":
        versions()
    elif a.what == "groups":
        groups(a.minutes)
    elif a.what == "step8b":
        step8b([int(x) for x in a.tokens.split(",")])
    else:
        eval8b(a.prompts, a.new_tokens)


if __name__ == "__main__":
    main()
