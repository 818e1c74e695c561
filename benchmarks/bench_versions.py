"""The CPU demo under two sets of package versions, side by side in one run: which version change
makes the demo slower or faster on this machine.

    pip install --no-deps --target /tmp/tf523 transformers==5.23.0   # a suspect version, kept apart
    python benchmarks/bench_versions.py --site transformers-5.23=/tmp/tf523 [--rounds 1] [--out FILE | --no-docs]

Each `--site NAME=DIR` is a folder of packages put first on PYTHONPATH, so its versions shadow the
environment's; the environment as installed (constraints/main.txt) is always measured as
"installed". Every measurement is the README's demo command (`accelerate launch train.py
recipe=smollm2-135m-demo`) in a fresh output folder, the package sets alternating run by run
(`--rounds` times each) so that both see the same machine load; the data cache is shared, and one
untimed warm-up run fills it first unless `--no-warmup`. The table gives, per package set, the
versions that ran (transformers, accelerate, torch, tokenizers), the wall time, training tokens/s,
and decoding tokens/s with the head and with the target alone (summary.json of each run). Prints the
table and writes it to docs/BENCHMARKS.md with the CPU model, its bf16 unit and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_tables import bench_arguments, machine_line, publish

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## The CPU demo under other package versions (benchmarks/bench_versions.py)"
PACKAGES = ("transformers", "accelerate", "torch", "tokenizers")


def _env(site: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([*([site] if site else []), str(ROOT)])
    return env


def versions(site: str | None) -> dict:
    code = ("import importlib.metadata as m, json; "
            f"print(json.dumps({{p: m.version(p) for p in {PACKAGES!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)  # a shadowing package's dist-info comes first on PYTHONPATH


def demo(site: str | None, out: Path) -> dict:
    """One demo run in `out`; returns its summary's numbers and the measured wall seconds."""
    cmd = ["accelerate", "launch", "--quiet", "--num_processes", "1", "train.py", "recipe=smollm2-135m-demo",
           f"output_dir={out}"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(site), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"bench_versions: the demo failed under {site or 'the installed packages'}:\n{p.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    ev = s.get("eval") or {}
    return {"wall_min": wall / 60, "train_tps": s["training"]["tokens_per_second"],
            "head_tps": ev.get("tokens_per_second"), "target_tps": ev.get("target_only_tokens_per_second"),
            "tau": ev.get("acceptance_length")}


def table(rows: list[tuple[str, dict, list[dict]]]) -> str:
    def med(runs, key):
        vals = sorted(r[key] for r in runs if r[key] is not None)
        return vals[len(vals) // 2] if vals else float("nan")

    lines = ["| packages | " + " | ".join(PACKAGES) + " | runs | wall time | training | with the head | target alone | τ |",
             "|---|" + "---|" * len(PACKAGES) + "---|---|---|---|---|---|"]
    for name, ver, runs in rows:
        lines.append(f"| {name} | " + " | ".join(ver[p] for p in PACKAGES) + f" | {len(runs)} | "
                     f"{med(runs, 'wall_min'):.2f} min | {med(runs, 'train_tps'):.0f} tokens/s | "
                     f"{med(runs, 'head_tps'):.1f} tokens/s | {med(runs, 'target_tps'):.1f} tokens/s | "
                     f"{med(runs, 'tau'):.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", action="append", default=[], metavar="NAME=DIR",
                    help="a folder of packages put first on PYTHONPATH (pip install --target DIR ...)")
    ap.add_argument("--rounds", type=int, default=1, help="demo runs per package set (alternating)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed run that fills the data cache")
    args = bench_arguments(ap, ROOT / "docs" / "BENCHMARKS.md", threads=None).parse_args()
    sets = [("installed", None)]
    for s in args.site:
        name, _, folder = s.partition("=")
        if not folder or not Path(folder).is_dir():
            sys.exit(f"bench_versions: --site {s}: give NAME=DIR with an existing folder of packages "
                     "(pip install --no-deps --target DIR PACKAGE==VERSION)")
        sets.append((name, folder))
    found = {name: versions(site) for name, site in sets}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_versions_") as tmp:
        if not args.no_warmup:
            demo(None, Path(tmp) / "warmup")
        runs: dict[str, list[dict]] = {name: [] for name, _ in sets}
        for r in range(args.rounds):
            for name, site in (sets if r % 2 == 0 else sets[::-1]):
                runs[name].append(demo(site, Path(tmp) / f"{name}-{r}"))
                print(name, runs[name][-1], flush=True)
    load1 = os.getloadavg()
    text = (f"{HEADING}\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine_line()}, "
            f"{os.cpu_count()} cores, load average {load0[0]:.2f} before and {load1[0]:.2f} after; "
            f"`python benchmarks/bench_versions.py {' '.join('--site ' + s for s in args.site)} "
            f"--rounds {args.rounds}`. Medians of the runs; each run is the README's demo command.\n\n"
            f"{table([(name, found[name], runs[name]) for name, _ in sets])}\n")
    publish(HEADING, text, args)


if __name__ == "__main__":
    main()
