from peagle_train.benchmarks import write_section


def test_write_section_replaces_its_own_section_only(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nb stays\n")
    write_section("## A", "## A\n\nnew a\n", doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nb stays\n"
    write_section("## B", "## B\n\nnew b", doc)  # the last section, no trailing newline given
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nnew b\n"
    write_section("## C", "## C\n\nc\n", doc)  # a new heading is appended
    assert doc.read_text().endswith("## B\n\nnew b\n\n## C\n\nc\n")


def test_every_benchmark_script_has_the_shared_options():
    """scripts/bench_*.py: one argument style (argparse with --out, --no-docs, --threads from
    `bench_arguments`) and the table path passed to write_section (the package has no default)."""
    import argparse
    import inspect
    from pathlib import Path

    from peagle_train.benchmarks import bench_arguments

    from .conftest import REPO_ROOT

    assert inspect.signature(write_section).parameters["path"].default is inspect.Parameter.empty
    a = bench_arguments(argparse.ArgumentParser(), Path("/x/BENCHMARKS.md"), threads=2).parse_args([])
    assert (a.out, a.no_docs, a.threads) == (Path("/x/BENCHMARKS.md"), False, 2)
    a = bench_arguments(argparse.ArgumentParser(), Path("d.md")).parse_args(["--out", "o.md", "--no-docs", "--threads", "3"])
    assert (a.out, a.no_docs, a.threads) == (Path("o.md"), True, 3)
    scripts = sorted((REPO_ROOT / "scripts").glob("bench_*.py"))
    assert len(scripts) == 11  # every bench_*.py of scripts/
    for path in scripts:
        src = path.read_text()
        if path.name == "bench_speculators_step.py":  # bench_draft.py's worker in the speculators venv (JSON argv)
            continue
        assert "bench_arguments(ap, " in src and "args.out" in src, path.name
        calls = [line for line in src.splitlines() if "write_section(" in line and "import" not in line]
        assert calls and all("args.out)" in line for line in calls), (path.name, calls)
