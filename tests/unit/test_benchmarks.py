import json

from bench_tables import publish, write_section  # benchmarks/ (pytest's pythonpath, pyproject.toml)


def test_write_section_replaces_its_own_section_only(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nb stays\n")
    write_section("## A", "## A\n\nnew a\n", doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nb stays\n"
    write_section("## B", "## B\n\nnew b", doc)  # the last section, no trailing newline given
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nnew b\n"
    write_section("## C", "## C\n\nc\n", doc)  # a new heading is appended
    assert doc.read_text().endswith("## B\n\nnew b\n\n## C\n\nc\n")


def test_publish_prints_and_writes_unless_no_docs(tmp_path, capsys):
    from types import SimpleNamespace

    doc = tmp_path / "BENCHMARKS.md"
    publish("## T", "## T\n\n| a |\n", SimpleNamespace(no_docs=True, out=doc))
    assert not doc.exists() and capsys.readouterr().out == "## T\n\n| a |\n\n"
    publish("## T", "## T\n\n| a |\n", SimpleNamespace(no_docs=False, out=doc))
    assert doc.read_text() == "# Benchmarks\n\n## T\n\n| a |\n"
    assert capsys.readouterr().out.endswith(f"written to {doc}\n")


def test_every_benchmark_script_has_the_shared_options():
    """benchmarks/bench_*.py: one argument style (argparse with --out, --no-docs, --threads from
    `bench_arguments`) and the table path passed to write_section (the package has no default), or
    the parsed arguments to `publish`."""
    import argparse
    import inspect
    from pathlib import Path

    from bench_tables import bench_arguments

    from ..conftest import REPO_ROOT

    assert inspect.signature(write_section).parameters["path"].default is inspect.Parameter.empty
    a = bench_arguments(argparse.ArgumentParser(), Path("/x/BENCHMARKS.md"), threads=2).parse_args([])
    assert (a.out, a.no_docs, a.threads) == (Path("/x/BENCHMARKS.md"), False, 2)
    a = bench_arguments(argparse.ArgumentParser(), Path("d.md")).parse_args(["--out", "o.md", "--no-docs", "--threads", "3"])
    assert (a.out, a.no_docs, a.threads) == (Path("o.md"), True, 3)
    scripts = sorted(p for p in (REPO_ROOT / "benchmarks").glob("bench_*.py") if p.name != "bench_tables.py")
    assert len(scripts) == 17  # every bench_*.py of benchmarks/ but bench_tables.py, what they share
    for path in scripts:
        src = path.read_text()
        if path.name == "bench_speculators_step.py":  # bench_draft.py's worker in the speculators venv (JSON argv)
            continue
        assert "bench_arguments(ap, " in src, path.name
        writes = [line for line in src.splitlines() if "write_section(" in line and "import" not in line]
        publishes = [line for line in src.splitlines() if "publish(" in line and "import" not in line]
        assert writes or publishes, path.name
        assert all("args.out)" in line for line in writes), (path.name, writes)
        assert all(line.rstrip().endswith(", args)") for line in publishes), (path.name, publishes)


def test_regeneration_rows_resume_only_under_the_same_settings(tmp_path):
    import pytest

    from bench_regenerate import append_row, finished_rows

    rows, settings = tmp_path / "rows.jsonl", {"cpu": "Xeon", "threads": 2, "new_tokens": 128}
    assert finished_rows(rows, settings) == {}
    append_row(rows, settings, ("hf", "greedy", 16, 16, 900, 1500, 9.5, None))
    append_row(rows, settings, ("vllm", "sampled", 64, 64, 3600, 7000, 30.0, 12.0))
    assert json.loads(rows.read_text().splitlines()[0]) == {"settings": settings}
    assert finished_rows(rows, settings) == {("hf", "greedy", 16): ["hf", "greedy", 16, 16, 900, 1500, 9.5, None],
                                             ("vllm", "sampled", 64): ["vllm", "sampled", 64, 64, 3600, 7000, 30.0, 12.0]}
    with pytest.raises(SystemExit, match=r"rows.jsonl: its rows were measured with other settings \(threads 2 there, "
                                         r"1 now, new_tokens 128 there, 256 now\)"):
        finished_rows(rows, {**settings, "threads": 1, "new_tokens": 256})
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(["hf", "greedy", 16, 16, 900, 1500, 9.5, None]) + "\n")  # a file from before the record
    with pytest.raises(SystemExit, match="old.jsonl: its first line is not a settings record"):
        finished_rows(old, settings)


def test_versions_table_gives_each_package_sets_medians():
    """bench_versions.table: one row per package set with its versions and the medians of its runs."""
    from bench_versions import table

    ver = {"transformers": "5.25.0", "accelerate": "1.16.0", "torch": "2.13.0+cpu", "tokenizers": "0.23.3"}
    runs = [{"wall_min": w, "train_tps": t, "head_tps": h, "target_tps": g, "tau": 1.18}
            for w, t, h, g in ((4.7, 757, 38.4, 39.6), (7.7, 609, 24.3, 23.9), (5.0, 700, None, 30.0))]
    assert table([("installed", ver, runs)]).splitlines()[2] == (
        "| installed | 5.25.0 | 1.16.0 | 2.13.0+cpu | 0.23.3 | 3 | 5.00 min | 700 tokens/s | 38.4 tokens/s | "
        "30.0 tokens/s | 1.180 |")


PYTEST_TAIL = """........ [100%]
tiers (tests, sum of their durations): unit 349 in 128 s, integration 323 in 895 s, e2e 10 in 968 s
============================ slowest 5 durations =============================
300.75s call     tests/e2e/test_vllm.py::test_vllm_serves_each_head_at_the_reference_tau
287.23s setup    tests/e2e/test_vllm.py::test_vllm_serves_each_head_at_the_reference_tau
79.60s call     tests/e2e/test_vllm.py::test_vllm_features_equal_ours_and_train
681 passed, 28 skipped, 22 warnings in 1157.68s (0:19:17)
"""


def test_suite_time_is_read_from_pytest_and_each_cpu_keeps_its_row(tmp_path):
    """bench_suite.parse reads the counts, pytest's seconds, the tiers' line (conftest.py) and the
    slowest phases; bench_suite.table replaces the row of the same CPU and keeps the others'."""
    from bench_suite import HEADING, parse, row, table

    res = parse(PYTEST_TAIL)
    assert res["counts"] == {"passed": 681, "skipped": 28}
    assert res["pytest_s"] == 1157.68
    assert res["tiers"] == {"unit": (349, 128.0), "integration": (323, 895.0), "e2e": (10, 968.0)}
    assert res["slow"][1] == ("287.23", "setup", "tests/e2e/test_vllm.py::test_vllm_serves_each_head_at_the_reference_tau")
    new = row("AMD EPYC (bf16 unit: none) as AVX2", res, 1200.4, 0.5, "abc1234")
    assert new.split(" | ")[2:5] == ["0.50", "681 / 28 / 0", "19.3 min (1158 s)"]  # pytest's own seconds
    assert new.split(" | ")[5] == "unit 349 / 128 s, integration 323 / 895 s, e2e 10 / 968 s"
    assert new.split(" | ")[6].startswith("test_vllm.py::test_vllm_serves_each_head_at_the_reference_tau (call) 301 s; "
                                          "test_vllm.py::test_vllm_serves_each_head_at_the_reference_tau (setup) 287 s; ")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# B\n\n## Next\n\nstays\n")
    write_section(HEADING, table(new, "AMD EPYC (bf16 unit: none) as AVX2", doc), doc)
    other = new.replace("| AMD EPYC (bf16 unit: none) as AVX2 |", "| Intel Xeon (bf16 unit: amx) |")
    write_section(HEADING, table(other, "Intel Xeon (bf16 unit: amx)", doc), doc)
    again = table(new.replace("19.3 min", "19.0 min"), "AMD EPYC (bf16 unit: none) as AVX2", doc)
    rows = [r for r in again.splitlines() if r.startswith("| ") and not r.startswith(("| CPU", "|---"))]
    assert len(rows) == 2 and "19.0 min" in rows[0] and "19.3 min" not in rows[0]  # the same CPU: replaced
    assert rows[1] == other  # another CPU's row kept
    assert doc.read_text().startswith(f"# B\n\n## Next\n\nstays\n\n{HEADING}\n")  # the other section kept
