"""The README's test command, timed: pytest's seconds, each tier's summed test durations and the slowest
tests, on this CPU or as on a CPU with AVX2 only (no AVX512, no AMX: fp32 wherever `precision=auto`).

    python benchmarks/bench_suite.py [--as-cpu avx2] [--probe] [--out FILE | --no-docs] [-- PYTEST_ARGS]

The command is `python -m pytest -q -n 2 --dist loadfile` (README "Run the tests"; PYTEST_ARGS are
added, e.g. `-m unit`), run from the checkout with the environment as installed. `--as-cpu avx2`
models the AVX2-only AMD EPYC this project meets on a machine whose CPU has AVX512 (the same code
paths, not that CPU's clock or caches): in a private mount namespace (`unshare --mount`, as root)
/proc/cpuinfo loses its avx512* and amx* flags, so `precision=auto` resolves to fp32
(peagle_train/precision.py `cpu_bf16_units`); PyTorch's kernels are capped at AVX2
(ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA); and `torch.cpu`'s AVX512 and
AMX probes answer False in every Python process of this venv and of vLLM's (a `.pth` file put in
each venv's site-packages for the run and removed after), so vLLM loads its AVX2 kernels
(`vllm._C_AVX2`); TorchInductor compiles into a cache of the run's own (a kernel cached for AVX512 and
reused under the model gave wrong block masks). `--probe` runs, in place of pytest, what each process
would see.

Prints a table and writes it into docs/BENCHMARKS.md under its own heading, one row per CPU (as
measured or modelled), a new run replacing the row of the same CPU; each row records the CPU model,
its bf16 unit, the load average before, the date and the commit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_tables import bench_arguments, cpu_model, publish

REPO = Path(__file__).resolve().parent.parent
HEADING = "## The test command's time (benchmarks/bench_suite.py)"
COMMAND = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
HIDDEN_FLAGS = re.compile(r" (avx512[a-z0-9_]*|amx[a-z0-9_]*)(?=\s)")
# run by the .pth line in each Python process that has PEAGLE_CPU_AS_HOOK set: `torch.cpu`, once
# imported, answers False to its AVX512 and AMX probes
HOOK = '''import importlib.abc, importlib.machinery, sys

class _TorchCpuAsAvx2(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for probe in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                          "_is_amx_tile_supported", "_is_amx_fp16_supported"):
                if hasattr(module, probe):
                    setattr(module, probe, lambda: False)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _TorchCpuAsAvx2())
'''
PTH = ('import os; exec(open(os.environ["PEAGLE_CPU_AS_HOOK"]).read(), {}) '
       'if os.environ.get("PEAGLE_CPU_AS_HOOK") else None\n')
PROBE = ("import os, torch, json; from peagle_train.precision import cpu_bf16_units, resolve_precision; "
         "print(json.dumps({'inductor_cache': os.environ.get('TORCHINDUCTOR_CACHE_DIR'), 'bf16_unit': cpu_bf16_units(), 'auto': str(resolve_precision('auto', 'cpu').dtype), "
         "'aten': torch.backends.cpu.get_cpu_capability(), 'avx512': torch.cpu._is_avx512_supported(), "
         "'amx': torch.cpu._is_amx_tile_supported()}))")
VLLM_PROBE = ("import torch, json, re; from vllm.platforms.cpu import CpuPlatform; CpuPlatform.import_kernels(); "
              "libs = sorted(set(re.findall(r'vllm/(_C\\w*)\\.abi3\\.so', open('/proc/self/maps').read()))); "
              "print(json.dumps({'avx512': torch.cpu._is_avx512_supported(), 'vllm_kernels': libs}))")


def _site_packages(python: str) -> Path:
    out = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def _vllm_python() -> str | None:
    from peagle_train.serving.vllm_engine import VllmError, vllm_python

    try:
        return vllm_python()
    except VllmError:
        return None


def as_avx2(tmp: Path, pythons: list[str]) -> tuple[list[str], dict, list[Path]]:
    """The AVX2-only model, built in `tmp`: (the argv prefix that runs a command in it, its env, the
    .pth files put into `pythons`' site-packages, which the caller removes). Raises SystemExit with
    one line where it cannot be built (not root, no `unshare`)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise SystemExit("bench_suite.py: --as-cpu avx2 needs root and unshare(1) (a private /proc/cpuinfo); "
                         "run it as root, or measure on an AVX2-only CPU without --as-cpu")
    cpuinfo = tmp / "cpuinfo"
    cpuinfo.write_text(HIDDEN_FLAGS.sub("", Path("/proc/cpuinfo").read_text()))
    hook = tmp / "torch_cpu_as_avx2.py"
    hook.write_text(HOOK)
    pths = [_site_packages(python) / "peagle_cpu_as.pth" for python in pythons]
    for pth in pths:
        pth.write_text(PTH)
    # TorchInductor's cache of its own: kernels compiled for this CPU's ISA are not reused
    env = {**os.environ, **AVX2_ENV, "PEAGLE_CPU_AS_HOOK": str(hook), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    return ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /proc/cpuinfo && exec "$@"', str(cpuinfo)], env, pths


def parse(output: str) -> dict:
    """From pytest's output under the project's conftest: passed/skipped/failed counts, pytest's
    own seconds, each tier's (tests, summed seconds) and the 5 slowest test phases."""
    last = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?)", last)}
    seconds = re.search(r" in ([\d.]+)s", last)
    tiers = {t: (int(n), float(s)) for t, n, s in re.findall(r"(unit|integration|e2e) (\d+) in ([\d.]+) s", output)}
    slow = re.findall(r"^([\d.]+)s (call|setup|teardown) +(\S+)", output, flags=re.M)[:5]
    return {"counts": counts, "pytest_s": float(seconds.group(1)) if seconds else None, "tiers": tiers, "slow": slow}


def row(label: str, res: dict, wall: float, load: float, commit: str) -> str:
    c, seconds = res["counts"], res["pytest_s"] or wall  # pytest's own seconds; the command's where it printed none
    tiers = ", ".join(f"{t} {n} / {s:.0f} s" for t, (n, s) in res["tiers"].items())
    slow = "; ".join(f"{n.split('/')[-1]} ({phase}) {float(s):.0f} s" for s, phase, n in res["slow"][:3])
    return (f"| {label} | {time.strftime('%Y-%m-%d')} {commit} | {load:.2f} | {c.get('passed', 0)} / "
            f"{c.get('skipped', 0)} / {c.get('failed', 0) + c.get('error', 0) + c.get('errors', 0)} | "
            f"{seconds / 60:.1f} min ({seconds:.0f} s) | {tiers} | {slow} |")


def table(new: str, label: str, path: Path) -> str:
    """The section: the existing rows of `path`'s section for other CPUs, and `new` for `label`."""
    header = ("| CPU | date, commit | load before | passed / skipped / failed | pytest wall | tiers: tests / summed "
              "s | slowest |\n|---|---|---|---|---|---|---|")
    rows = []
    if path.is_file() and HEADING in (text := path.read_text()):
        body = text[text.index(HEADING):].split("\n## ", 1)[0]
        rows = [r for r in body.splitlines() if r.startswith("| ") and not r.startswith(("| CPU ", "|---"))
                and r.split(" | ")[0] != f"| {label}"]
    return (f"{HEADING}\n\n`{' '.join(['python -m pytest', *COMMAND[3:]])}` (README \"Run the tests\", the "
            "install excluded), timed by `python benchmarks/bench_suite.py`; tiers: tests, and the sum of their "
            "durations over both workers (conftest.py). \"as AVX2\": on a CPU with AVX512, its avx512 and amx "
            "flags hidden and PyTorch and vLLM capped at AVX2 (`--as-cpu avx2`): the code paths of an AVX2-only "
            f"CPU, not its clock.\n\n{header}\n" + "\n".join(sorted([*rows, new])) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap = bench_arguments(ap, REPO / "docs" / "BENCHMARKS.md", threads=None)
    ap.add_argument("--as-cpu", choices=["avx2"], help="run as on a CPU with AVX2 only (root: unshare --mount)")
    ap.add_argument("--probe", action="store_true", help="print what the processes see; run no tests")
    ap.add_argument("pytest_args", nargs="*", help="added to the pytest command (after --)")
    args = ap.parse_args(argv)
    vllm = _vllm_python()
    probes = [[sys.executable, "-c", PROBE]] + ([[vllm, "-c", VLLM_PROBE]] if vllm else [])
    commands = probes if args.probe else [COMMAND + ["--durations=5"] + args.pytest_args]
    from peagle_train.precision import cpu_bf16_units

    label = f"{cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'})" + (" as AVX2" if args.as_cpu else "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    outputs, load, t0 = [], os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        prefix, env, pths = as_avx2(Path(tmp), [sys.executable, *filter(None, [vllm])]) if args.as_cpu else \
            ([], os.environ.copy(), [])
        try:
            for command in commands:
                proc = subprocess.run(prefix + command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                print(proc.stdout.strip())
                outputs.append(proc)
        finally:
            for pth in pths:
                pth.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    if args.probe:
        return max(p.returncode for p in outputs)
    res = parse(outputs[0].stdout)
    publish(HEADING, table(row(label, res, wall, load, commit), label, args.out), args)
    return outputs[0].returncode


if __name__ == "__main__":
    sys.exit(main())
