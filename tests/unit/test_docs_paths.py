"""Every repository path the docs and the package's own text cite exists.

Read: README.md and docs/*.md (their prose, code blocks and markdown links), and every .py file
under peagle_train/ (docstrings, comments and strings alike). A cited path is a token that starts
at a word boundary with a folder of this repository (`peagle_train/`, `scripts/`, `docs/`, `tests/`,
`recipes/`, `benchmarks/`, `experiments/`, `conf/`, `data/`) or of the package (`training/`,
`draft/`, `algorithms/`, ...: resolved against peagle_train/), and names a file by its extension;
a token without an extension that starts with `peagle_train/`, `docs/`, `tests/`, `scripts/`,
`benchmarks/` or `experiments/` names a folder. A markdown link
target is resolved against the folder of the file that holds it, as a renderer does.

Not paths of this repository, so never checked: URLs, other projects' paths (vLLM's `vllm/...`,
DeepSpeed's `runtime/...`: their first folder is none of ours, or the token continues one, as in
`src/speculators/train/...`), placeholders (`RUN/...`, `recipes/NAME.yaml`, `<dir>/...`, `…`),
globs (`bench_*.py`), and what a run writes (`data/summary.json`, `output_dir/...`: see
`RUN_OUTPUTS`).

The benchmark, experiment and install scripts and the tests are held to the same paths (not
experiments/ARCHIVE.md nor CHANGELOG.md, which cite paths as they were), and every dotted name of
the package that any of them cites (`peagle_train.evaluation.report.summarize`) names a module, a
function or class defined at a module's top, or a class's member: code that moved is cited where it
lives now.

And the pages a reader opens first stay short (`DOC_LINE_LIMITS`): README.md at most 200 lines,
docs/RESULTS.md and docs/STATUS.md under 300; long tables go to docs/BENCHMARKS.md, superseded runs
to experiments/ARCHIVE.md."""

import ast
import re
from pathlib import Path

from ..conftest import REPO_ROOT

PKG = REPO_ROOT / "peagle_train"

# First folders of a repository-relative path, and of a package-relative one (resolved against
# peagle_train/, or the repository root where both hold the name, as data/ and conf/ do).
REPO_DIRS = ("peagle_train", "scripts", "docs", "tests", "recipes", "benchmarks", "experiments", "conf", "data")
# Folders cited without an extension are checked under these only (`data/eval/export` in prose is a
# list of config groups, not a folder).
FOLDER_ROOTS = ("peagle_train", "scripts", "docs", "tests", "benchmarks", "experiments")
PKG_DIRS = ("accel", "algorithms", "cli", "data", "decoding", "draft", "evaluation", "export", "features",
            "recommend", "serving", "target", "training", "conf", "recipes", "spec_bench", "jobs")
FILE_EXTS = ("py", "md", "sh", "yaml", "yml", "png", "cpp", "toml", "json", "jsonl", "txt")

# Files a run writes under its output_dir, named in the docs by their place there (REFERENCE.md,
# "What a run writes"; DATA.md): not files of the repository.
RUN_OUTPUTS = ("data/summary.json", "data/rows", "data/draft_vocab.safetensors", "data/manifest.json",
               "data/packed", "data/rows.jsonl", "export/config.json", "export/model.safetensors")

_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
_TOKEN = re.compile(r"(?<![\w./~$<{-])((?:[\w.-]+/)+[\w.-]*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PLACEHOLDER_DIR = re.compile(r"(^|/)[A-Z][A-Z0-9_]*/")
_PLACEHOLDER_STEMS = {"NAME", "FILE", "OUT", "DIR", "X"}


def _is_placeholder(token: str) -> bool:
    """True for `RUN/...`, `runs/X/`, `recipes/NAME.yaml`: a folder in capitals, or a file called
    NAME or the like, stands for a value (docs/RESULTS.md is a file)."""
    stem = token.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    return bool(_PLACEHOLDER_DIR.search(token)) or stem in _PLACEHOLDER_STEMS or "..." in token


def cited_paths(text: str) -> list[str]:
    """The repository paths `text` cites, in order, each once: repository-relative
    (`docs/RESULTS.md`, `peagle_train/accel/cpu`) or package-relative (`training/trainer.py`).
    Markdown link targets are not included (`link_targets`)."""
    text = _URL.sub(" ", text)
    found = []
    for m in _TOKEN.finditer(text):
        tok = m.group(1).rstrip(".")
        end = m.end(1)
        if end < len(text) and text[end] in "*?<>{}[…":  # a glob or a placeholder continues it
            continue
        first, _, rest = tok.partition("/")
        if not rest or _is_placeholder(tok) or tok in RUN_OUTPUTS or tok.rstrip("/") in RUN_OUTPUTS:
            continue
        ext = rest.rsplit(".", 1)[-1] if "." in rest.rsplit("/", 1)[-1] else ""
        if ext and ext not in FILE_EXTS:
            continue
        if (ext and (first in REPO_DIRS or first in PKG_DIRS)) or (not ext and first in FOLDER_ROOTS):
            if tok not in found:
                found.append(tok)
    return found


def link_targets(text: str) -> list[str]:
    """The local targets of markdown links in `text` (`[x](../CHANGELOG.md#anchor)` →
    `../CHANGELOG.md`), URLs and in-page anchors left out."""
    out = []
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if ("." in target or "/" in target) and not _URL.match(target) and not target.startswith("mailto:"):
            out.append(target)
    return out


def path_exists(token: str) -> bool:
    """Whether `token` names a file or folder of the repository, at its root or (package-relative
    forms) under peagle_train/."""
    tok = token.rstrip("/")
    return (REPO_ROOT / tok).exists() or (PKG / tok).exists()


def missing_paths(text: str, where: Path | None = None) -> list[str]:
    """The paths cited in `text` that do not exist, and (with `where`, the file holding `text`)
    the markdown link targets that do not resolve from its folder."""
    missing = [p for p in cited_paths(text) if not path_exists(p)]
    if where is not None:
        missing += [f"link {t}" for t in link_targets(text) if not (where.parent / t).exists()]
    return missing


def _sources() -> list[Path]:
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    return docs + sorted(PKG.rglob("*.py"))


def _script_sources() -> list[Path]:
    """The benchmark, experiment and install scripts and the tests (this file, whose samples are
    made up, left out). Not experiments/ARCHIVE.md nor CHANGELOG.md: they cite paths as they were."""
    out = [f for d in ("benchmarks", "experiments", "scripts") for ext in ("py", "sh")
           for f in sorted((REPO_ROOT / d).glob(f"*.{ext}"))]
    return out + [f for f in sorted((REPO_ROOT / "tests").rglob("*.py")) if f.name != Path(__file__).name]


# A dotted name of the package (`peagle_train.evaluation.report.summarize`); not one that a call
# makes up as it stands (a logger's name, a module loaded from a file) nor a dunder (`__file__`).
_DOTTED = re.compile(r"(?<![\w.])peagle_train(?:\.[A-Za-z_]\w*)+")
_NAMING_CALLS = ("getLogger(", "spec_from_file_location(")


def _top_level_names(path: Path) -> dict[str, ast.AST | None]:
    """{name: its node (a class's, to look its members up) or None} of what module `path` defines
    or imports at its top level."""
    out: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for tgt in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(tgt, ast.Name):
                    out[tgt.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = None
    return out


def dotted_name_exists(name: str) -> bool:
    """Whether `peagle_train.a.b[.c]` names a module of the package, a name defined at the top of
    one, or a member (method, attribute) of a class defined there; read from the source, nothing
    imported."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO_ROOT.joinpath(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            continue
        rest = parts[i:]
        if not rest:
            return True
        names = _top_level_names(module)
        if rest[0] not in names:
            return False
        node = names[rest[0]]
        if len(rest) == 1 or not isinstance(node, ast.ClassDef):
            return True
        members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        members |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        return rest[1] in members
    return False


def missing_names(text: str) -> list[str]:
    """The package's dotted names cited in `text` that name nothing (a module moved or a function
    renamed), each once."""
    out = []
    for m in _DOTTED.finditer(text):
        name = m.group(0)
        if "__" in name or text[max(0, m.start() - 30):m.start()].rstrip("\"'").endswith(_NAMING_CALLS):
            continue
        if not dotted_name_exists(name) and name not in out:
            out.append(name)
    return out


def test_extractor_finds_a_made_up_path():
    sample = ("The trainer (`training/trainer.py`) reads docs/RESULTS.md and peagle_train/nowhere/gone.py; "
              "see [the status](docs/STATUS.md), https://github.com/x/y/blob/main/docs/absent.md, vLLM's "
              "vllm/v1/spec_decode/eagle.py, src/speculators/train/trainer.py, recipes/NAME.yaml, "
              "RUN/eval/acceptance.json, benchmarks/bench_*.py, <dir>/recipe/x.yaml and data/summary.json.")
    assert cited_paths(sample) == ["training/trainer.py", "docs/RESULTS.md", "peagle_train/nowhere/gone.py",
                                   "docs/STATUS.md"]
    assert missing_paths(sample) == ["peagle_train/nowhere/gone.py"]
    assert link_targets(sample) == ["docs/STATUS.md"]
    assert missing_paths("[x](../nowhere.md) [y](RESULTS.md#which) E[τ](K)", REPO_ROOT / "docs" / "RESULTS.md") == [
        "link ../nowhere.md"]
    assert cited_paths("the data/eval/export groups; peagle_train/accel/cpu and docs/sweeps/k_train/") == [
        "peagle_train/accel/cpu", "docs/sweeps/k_train/"]


def test_a_moved_function_is_found_by_its_dotted_name():
    assert dotted_name_exists("peagle_train.evaluation.report.summarize")
    assert dotted_name_exists("peagle_train.evaluation.run.ResultLog.add")
    assert dotted_name_exists("peagle_train.training")
    assert missing_names("see peagle_train.decoding.decoder.speculative_generate and "
                         "peagle_train.export.speculators.model_card; logging.getLogger(\"peagle_train.train\"), "
                         "peagle_train.__file__") == ["peagle_train.decoding.decoder.speculative_generate"]


def test_every_cited_package_name_exists():
    problems = [f"{f.relative_to(REPO_ROOT)}: {n}" for f in _sources() + _script_sources() if f.name != Path(__file__).name
                for n in missing_names(f.read_text(encoding="utf-8"))]
    assert not problems, "package names cited but defined nowhere (moved or renamed? cite where it lives now):\n  " + \
        "\n  ".join(problems)


def test_every_path_the_scripts_and_tests_cite_exists():
    problems = [f"{f.relative_to(REPO_ROOT)}: {p}" for f in _script_sources()
                for p in missing_paths(f.read_text(encoding="utf-8"))]
    assert not problems, "paths cited but not in the repository:\n  " + "\n  ".join(problems)


def test_every_cited_path_exists():
    problems = []
    for f in _sources():
        text = f.read_text(encoding="utf-8")
        md = f.suffix == ".md"
        for p in missing_paths(text, f if md else None):
            problems.append(f"{f.relative_to(REPO_ROOT)}: {p}")
    assert not problems, "paths cited but not in the repository:\n  " + "\n  ".join(problems)


# The pages a reader opens first stay short enough to read: detail moves out instead of piling up.
DOC_LINE_LIMITS = {"README.md": 200, "docs/RESULTS.md": 299, "docs/STATUS.md": 299}


def overlong_docs(limits: dict[str, int], root: Path = REPO_ROOT) -> list[str]:
    """One message per file of `limits` ({path relative to `root`: most lines allowed}) that holds
    more lines than its limit, naming the file, its count, the limit and the fix."""
    out = []
    for rel, limit in limits.items():
        n = len((root / rel).read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{rel}: {n} lines, over its limit of {limit}. Fix: keep the newest answer there and move "
                       f"detail to docs/BENCHMARKS.md (long tables) or experiments/ARCHIVE.md (superseded runs, history)")
    return out


def test_the_front_pages_stay_short():
    problems = overlong_docs(DOC_LINE_LIMITS)
    assert not problems, "\n".join(problems)


def test_an_overlong_page_is_named_with_its_count_and_the_fix(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "RESULTS.md").write_text("line\n" * 301)
    (tmp_path / "README.md").write_text("line\n" * 200)
    assert overlong_docs({"README.md": 200, "docs/RESULTS.md": 299}, tmp_path) == [
        "docs/RESULTS.md: 301 lines, over its limit of 299. Fix: keep the newest answer there and move detail to "
        "docs/BENCHMARKS.md (long tables) or experiments/ARCHIVE.md (superseded runs, history)"]
