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
