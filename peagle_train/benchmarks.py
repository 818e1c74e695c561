"""Shared by the benchmark scripts (scripts/bench_*.py): their tables go into docs/BENCHMARKS.md."""

from __future__ import annotations

import platform
from pathlib import Path

from .io import atomic_write_text
from .paths import REPO_ROOT

BENCHMARKS_MD = REPO_ROOT / "docs" / "BENCHMARKS.md"


def write_section(heading: str, section: str, path: str | Path = BENCHMARKS_MD) -> Path:
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
