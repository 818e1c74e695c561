"""Shared by the benchmark scripts (benchmarks/bench_*.py): their tables go into the markdown file they
pass (`--out`, default the checkout's docs/BENCHMARKS.md, computed in benchmarks/)."""

from __future__ import annotations

import platform
from pathlib import Path

from peagle_train.io import atomic_write_text


def write_section(heading: str, section: str, path: str | Path) -> Path:
    """Put `section` (markdown that starts with the line `heading`, e.g. "## Data preparation")
    into `path`: it replaces the existing section of that heading (up to the next "## " heading)
    and leaves every other section alone, or is appended when the heading is new. Returns the path."""
    path = Path(path)
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    section = section.rstrip("\n") + "\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    atomic_write_text(path, text)
    return path


def publish(heading: str, section: str, args) -> None:
    """Print a benchmark's `section` (markdown starting with `heading`) and, unless `--no-docs`,
    write it into `args.out` (`write_section`), saying where."""
    print(section)
    if not args.no_docs:
        print(f"written to {write_section(heading, section, args.out)}")


def bench_arguments(ap, docs: Path, threads: int | None = 1):
    """Add the options every benchmark script has to its argparse parser `ap` and return it:
    `--out FILE` (the markdown file its table goes into; default `docs`, the checkout's
    docs/BENCHMARKS.md as the script computes it from its own path), `--no-docs` (print the table
    only) and `--threads N` (torch threads; default `threads`; the machine is shared)."""
    ap.add_argument("--out", type=Path, default=docs, help=f"markdown file the table goes into (default {docs})")
    ap.add_argument("--no-docs", action="store_true", help="print the table only, write no file")
    ap.add_argument("--threads", type=int, default=threads, help=f"torch threads (default {threads})")
    return ap


def machine_line() -> str:
    """The CPU model and its bf16 unit, as every benchmark table names its machine:
    "Intel(R) Xeon(R) Processor (bf16 unit: amx)"."""
    from peagle_train.precision import cpu_bf16_units

    return f"{cpu_model()} (bf16 unit: {cpu_bf16_units() or 'none'})"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("AMD EPYC", "Intel(R) Xeon(R) ..."), else the
    platform's processor or machine name. Every benchmark table records it with the bf16 unit
    (`peagle_train.precision.cpu_bf16_units`) and the load."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
