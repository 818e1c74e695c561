"""The house's import rules: data/ imports nothing above it (the regeneration backends live with
their engines) and evaluation/ nothing of data/; errors.py holds the errors and runtime.py the
process (the wrapper, Ctrl-C); no module registers an attention function at
import; only the job runner drives the trainer, and `peagle train` and the dry
run share it; the feature side imports no training code; the trainer has no algorithm branch and
no engine branch (DDP is an engine like the others); one module owns the feature-shard format; the
import graph has no circles, the heads (draft/) are a leaf, the core never imports the CPU plug-in
(accel/), no two modules or classes share a name, and the lab (benchmarks/, experiments/) stays out
of the package, with scripts/ holding only the product's files; no function is over MAX_FUNCTION_LINES
lines unless its docstring says why it cannot be split; K ≤ K_train is checked by one rule, and
evaluation and training take typed settings; the jobs a command runs live in jobs/, and the package
root holds only shared services; every rule on aux layer ids lives in target/aux_layers.py, and the
head's description (its speculators format included) in draft/; dtype names and torch dtypes are
converted by one table (precision.py)."""

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from ..conftest import REPO_ROOT

PKG = REPO_ROOT / "peagle_train"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the peagle_train modules a file imports (relative imports resolved)."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names.add(mod)
            names |= {f"{mod}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("peagle_train")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every import counted (those inside functions
    too); `from pkg import name` is an edge to pkg.name when that is a module, else to pkg."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    m = a.name
                    while m and m not in files:
                        m = m.rpartition(".")[0]
                    edges.add(m)
            elif isinstance(node, ast.ImportFrom):
                base = parts[:len(parts) - node.level] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                edges |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names}
        graph[name] = {m for m in edges if m in files and m != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_circles_are_found_and_the_package_has_none():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "peagle_train.features.shards" in graph["peagle_train.features"]  # `from .shards import X`
    assert import_circles(graph) == []


def test_heads_are_a_leaf():
    """draft/ (the heads, their checkpoints and KV cache) imports nothing of decoding, export,
    evaluation or the commands: those import the heads."""
    above = ("peagle_train.decoding", "peagle_train.export", "peagle_train.evaluation", "peagle_train.recommend",
             "peagle_train.cli", "peagle_train.accel")
    for path in (PKG / "draft").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(above)}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_the_core_never_imports_the_cpu_plugin():
    """accel/ plugs in from outside: no module outside it imports it, except evaluation's one call
    `accelerate_for_decoding`, imported inside the function that makes it (so importing the
    evaluation, the trainer or the commands loads no kernel code)."""
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("accel/"):
            continue
        bad = {m for m in imported_modules(path) if m.startswith("peagle_train.accel")}
        if rel == "evaluation/run.py":
            assert bad == {"peagle_train.accel.cpu", "peagle_train.accel.cpu.accelerate_for_decoding"}, bad
            top = {m for node in ast.parse(path.read_text()).body if isinstance(node, ast.ImportFrom)
                   for m in [node.module or ""] if "accel" in m}
            assert not top, "evaluation/run.py imports accel/ at module level"
        else:
            assert not bad, f"{rel} imports {bad}"
    code = ("import sys, peagle_train.cli.train, peagle_train.cli.evaluate, peagle_train.training.trainer; "
            "print(sorted(m for m in sys.modules if m.startswith('peagle_train.accel')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] + out.stdout


def test_nothing_below_the_trainer_imports_it():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel == "training/trainer.py":
            continue
        bad = {m for m in imported_modules(path) if m.startswith("peagle_train.training.trainer")}
        if rel != "jobs/training_job.py":  # the job runner drives the trainer
            assert not bad, f"{rel} imports {bad}"


def test_train_and_the_dry_run_share_one_job_runner():
    """`peagle train` and the dry run reach training, evaluation and export only through the job
    runner (jobs/training_job.py run_training_job), so the sequence exists once."""
    stages = ("peagle_train.training.trainer", "peagle_train.evaluation.run", "peagle_train.export.speculators.write_export",
              "peagle_train.draft.head_files.save_checkpoint")
    for rel in ("cli/train.py", "jobs/dry_run.py"):
        mods = imported_modules(PKG / rel)
        assert "peagle_train.jobs.training_job.run_training_job" in mods, rel
        bad = {m for m in mods if m.startswith(stages)}
        assert not bad, f"{rel} imports {bad}"


def test_ddp_is_an_engine_like_the_others():
    """The trainer holds one engine (training/engines.py: DDP, DeepSpeed or FSDP2) and never asks
    which: no comparison with an engine's name and no test of whether an engine exists."""
    tree = ast.parse((PKG / "training" / "trainer.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = {getattr(x, "value", None) for x in [node.left, *node.comparators]}
            assert not consts & {"ddp", "deepspeed", "fsdp"}, ast.unparse(node)
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = node.test.values if isinstance(node.test, ast.BoolOp) else [node.test]
            for t in tests:  # `if self.eng`, `if eng is None`, `if engine_kind ...`: a branch on which engine
                t = t.operand if isinstance(t, ast.UnaryOp) else t
                t = t.left if isinstance(t, ast.Compare) else t
                assert getattr(t, "attr", getattr(t, "id", None)) not in ("eng", "engine", "engine_kind"), ast.unparse(node)


def test_one_module_owns_the_feature_shard_format():
    """features/shards.py writes, converts and reads offline features; no other module names a
    shard file, its tensors or its quantisation."""
    owner = PKG / "features" / "shards.py"
    marks = ('"shard-', "shard-{", '"aux_scale"', '"final_scale"', '"offsets"', "safe_open(")
    for path in PKG.rglob("*.py"):
        if path == owner:
            continue
        text = path.read_text()
        assert not [m for m in marks if m in text], f"{path.relative_to(PKG)} knows the shard format"
        bad = {m for m in imported_modules(path) if m.startswith("peagle_train.features.shards.")
               and m.rpartition(".")[2] in ("shard_name", "quantize_int8", "dequantize_int8", "MANIFEST", "_compare")}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"
    assert all(m in owner.read_text() for m in marks)


def test_only_the_commands_import_the_cli():
    """peagle_train/cli/ is the top of the house: no module below it imports it."""
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith("cli/"):
            bad = {m for m in imported_modules(path) if m.startswith("peagle_train.cli")}
            assert not bad, f"{rel} imports {bad}"


def test_algorithms_import_nothing_of_the_trainer_side():
    """algorithms/ (objectives, COD sampling, losses) sits below training/: the trainer imports the
    objectives, never the other way round."""
    for path in (PKG / "algorithms").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith("peagle_train.training")}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_feature_side_imports_no_training_code():
    for sub in ("target", "features", "draft"):
        for path in (PKG / sub).rglob("*.py"):
            bad = {m for m in imported_modules(path) if m.startswith(("peagle_train.training", "peagle_train.algorithms"))}
            assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_data_imports_nothing_above_it():
    """data/ (conversations, token rows, the draft vocabulary, regeneration's replay and output) sits
    below everything that runs a model: the regeneration backends live next to the engines they
    drive (decoding/hf_backend.py, serving/backends.py) and `peagle regenerate` picks one."""
    above = tuple(f"peagle_train.{p}" for p in ("decoding", "serving", "evaluation", "training", "target", "features",
                                                "draft", "algorithms", "recommend", "export", "accel", "cli"))
    for path in (PKG / "data").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(above)}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_evaluation_imports_nothing_of_data():
    """evaluation/ checksums its report files through provenance.py, not data/'s manifest."""
    for path in (PKG / "evaluation").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith("peagle_train.data")}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_errors_holds_the_errors_and_runtime_the_process():
    """errors.py holds the user errors and the I/O failure helpers; the entry-point wrapper (Hydra)
    and Ctrl-C (signals, the watchdog thread) are runtime.py's."""
    tree = ast.parse((PKG / "errors.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"signal", "threading", "hydra", "omegaconf"}, imported
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not defined & {"cli_main", "guarded", "user_error_message", "_on_sigint", "_arm_exit_watchdog"}, defined
    assert {"cli_main", "guarded", "user_error_message"} <= {
        n.name for n in ast.parse((PKG / "runtime.py").read_text()).body if isinstance(n, ast.FunctionDef)}


def test_no_module_registers_attention_at_import():
    """Importing any module of the package leaves transformers' attention interfaces as they were;
    `register_attention` (called by FeatureTarget) and `register_amx_attention` (called by
    use_amx_attention) register the package's functions."""
    code = textwrap.dedent("""
        import importlib, pkgutil
        import peagle_train
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        ours = lambda: sorted(k for m in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
                              for k in m if k.startswith("peagle"))
        before = ours()
        for m in pkgutil.walk_packages(peagle_train.__path__, "peagle_train."):
            if m.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(m.name)
            except ModuleNotFoundError as e:  # an optional dependency (vllm) that is not installed
                if (e.name or "").startswith("peagle_train"):
                    raise
        print(before, ours())
        from peagle_train.target.capture import register_attention
        from peagle_train.accel.cpu.attention import register_amx_attention
        register_attention()
        register_amx_attention()
        print(ours())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-2:] == [
        "[] []", "['peagle_amx_decode', 'peagle_amx_decode', 'peagle_decode', 'peagle_decode', 'peagle_documents']"]


ALGORITHMS = {"peagle", "eagle3", "dflash"}


def algorithm_comparisons(source: str) -> list[str]:
    """The comparisons in `source` that branch on an algorithm's name: an `algorithm` (name or
    attribute) or `speculators_model_type` (key) compared with a string, or anything compared with
    (or looked up in a collection of) "peagle", "eagle3" or "dflash"."""
    def strings(node):
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {x.value for x in items if isinstance(x, ast.Constant) and isinstance(x.value, str)}

    def names_algorithm(node):
        return (getattr(node, "id", None) == "algorithm" or getattr(node, "attr", None) == "algorithm"
                or "speculators_model_type" in ast.unparse(node))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            consts = set().union(*(strings(x) for x in operands))
            if consts & ALGORITHMS or (consts and any(names_algorithm(x) for x in operands)):
                found.append(ast.unparse(node))
    return found


def test_no_module_outside_draft_branches_on_an_algorithm_name():
    """A head's rules live in its description class (draft/head_config.py: `masked`, `aux_count`,
    `serve_method`, `train_embeddings_default`, ...): no module outside draft/ compares an algorithm
    to a string."""
    assert algorithm_comparisons('if cfg.algorithm == "x": pass') == ["cfg.algorithm == 'x'"]
    assert algorithm_comparisons('k = c["speculators_model_type"] != "eagle3"') == [
        "c['speculators_model_type'] != 'eagle3'"]
    assert algorithm_comparisons('ok = kind in ("peagle", "dflash")') == ["kind in ('peagle', 'dflash')"]
    assert algorithm_comparisons('ok = kind == "ddp" and cfg.masked') == []
    found = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if not rel.startswith("draft/") and (hits := algorithm_comparisons(path.read_text())):
            found[rel] = hits
    assert not found, found


def test_trainer_has_no_algorithm_branch():
    src = (PKG / "training" / "trainer.py").read_text()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = {getattr(x, "attr", None) for x in [node.left, *node.comparators]}
            consts = {getattr(x, "value", None) for x in [node.left, *node.comparators]}
            assert "algorithm" not in names and not consts & {"peagle", "eagle3"}, ast.unparse(node)


def test_no_sys_path_insert_and_the_package_never_uses_the_checkout():
    """Scripts and tests import the installed (or PYTHONPATH) package; the package finds its own
    files as package data and has no notion of a checkout root."""
    from ..conftest import REPO_ROOT as root

    for path in [*PKG.rglob("*.py"), *(root / "scripts").glob("*.py"), *(root / "tests").rglob("*.py"), root / "train.py"]:
        if path.name == "test_layout.py":
            continue
        assert "sys.path.insert" not in path.read_text(), path
    for path in PKG.rglob("*.py"):
        assert "REPO_ROOT" not in path.read_text() and "parent.parent" not in path.read_text(), path


def test_no_timings_in_docstrings():
    """Measured times live in docs/BENCHMARKS.md, not in docstrings (they go stale with the machine)."""
    import re

    timing = re.compile(r"\b\d+(\.\d+)? ?(ms|µs|s/step|tokens/s|tok/s|GB/s)\b")
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                found += [f"{path.relative_to(PKG)}: {m.group(0)}" for m in timing.finditer(doc)]
    assert not found, found


def test_no_two_modules_or_classes_share_a_name():
    """A name means one thing: no two modules (or a module and a package) of the package share a
    name, and no two top-level classes do. Exempt by design: cli/'s modules are named after their
    commands (`peagle train` is cli/train.py), and an algorithm's head (draft/<algorithm>.py) and
    objective (algorithms/<algorithm>.py) share the algorithm's name."""
    import collections

    modules, classes = collections.defaultdict(list), collections.defaultdict(list)
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if path.name == "__init__.py" and path.parent != PKG:
            modules[path.parent.name].append(rel.rpartition("/")[0] + "/")
        elif path.name not in ("__init__.py", "__main__.py") and not rel.startswith("cli/"):
            modules[path.stem].append(rel)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(rel)
    per_algorithm = lambda paths: sorted(p.split("/")[0] for p in paths) == ["algorithms", "draft"]  # noqa: E731
    shared = {n: p for n, p in modules.items() if len(p) > 1 and not per_algorithm(p)}
    assert not shared, shared
    assert not {n: p for n, p in classes.items() if len(p) > 1}


MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """{qualified name (Class.method, outer.inner): lines} of the functions of `source` longer than
    `limit` lines, counted from `def` to their last line (decorators excluded, docstring included),
    whose docstring does not say they "cannot be split"."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > limit \
                        and "cannot be split" not in (ast.get_docstring(child) or ""):
                    found[name] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_is_over_80_lines_unless_it_says_why():
    """A function does one thing: none in the package is over MAX_FUNCTION_LINES lines unless its
    docstring says why it cannot be split."""
    def stmts(n, indent):  # n lines of body
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    toy = ("def at_limit():\n" + stmts(79, "    ")  # 80 lines: kept
           + "def over():\n" + stmts(80, "    ")  # 81
           + "class C:\n    def m(self):\n        def inner():\n" + stmts(80, "            ")  # inner 81
           + "        return inner\n"  # m: 1 + 81 + 1 = 83
           + 'def says_why():\n    """One table: it cannot be split."""\n' + stmts(80, "    "))
    assert long_functions(toy) == {"over": 81, "C.m": 83, "C.m.inner": 81}
    found = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        found |= {(rel, name): n for name, n in long_functions(path.read_text()).items()}
    over = {f"{rel} {name}": n for (rel, name), n in found.items()}
    assert not over, f"over {MAX_FUNCTION_LINES} lines (split them, or say in the docstring why they cannot be split): {over}"


# scripts/ is the product's own: install, the install and GPU checks, the speculators client check
SCRIPTS = ("check_install.sh", "check_speculators.py", "check_speculators.sh", "compat_exports.py", "gpu_check.py",
           "gpu_check.sh", "gpu_image.txt", "gpu_wheels.txt", "install.sh", "refresh_constraints.sh")


def test_the_lab_stays_out_of_the_product():
    """benchmarks/ and experiments/ are the lab: no module of the package imports one of theirs (nor the
    folders by name), and scripts/ holds only the product's files (SCRIPTS); the commands are
    `peagle <command>`, with no script shims beside them."""
    lab = {"benchmarks", "experiments"} | {p.stem for d in ("benchmarks", "experiments") for p in (REPO_ROOT / d).glob("*.py")}
    assert {"bench_tables", "scaling"} <= lab
    for path in PKG.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        assert not names & lab, f"{path.relative_to(PKG)} imports {sorted(names & lab)} of the lab"
    assert sorted(p.name for p in (REPO_ROOT / "scripts").iterdir() if p.name != "__pycache__") == sorted(SCRIPTS)


def test_one_num_depths_check_and_typed_settings():
    """K ≤ K_train has one rule (config.py `k_beyond_num_depths_problem`), applied by the train config's
    check (`config_problems`) and by `EvalSettings.check_head` (every head `peagle evaluate`
    decodes), nowhere else; evaluation and training take typed settings (EvalSettings,
    TrainSettings): no bag of evaluation keys, no flat trainer config mapped back to the schema."""
    callers, names = set(), set()
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                    "k_beyond_num_depths_problem":
                callers.add(rel)
            elif isinstance(node, (ast.Name, ast.FunctionDef)):
                names.add(getattr(node, "id", getattr(node, "name", None)))
    assert callers == {"config.py", "evaluation/settings.py"}, callers
    assert not names & {"EVAL_KEYS", "evaluate_from_config", "train_config", "SCHEMA_KEY"}


def k_train_identifiers(source: str) -> list[str]:
    """The identifiers (names, attributes, arguments, functions, keyword names) of `source` that
    spell K_train `k_train` instead of its one name, `num_depths`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = (getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
                or (node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None))
        if isinstance(name, str) and re.search(r"(^|_)k_train($|_)", name.lower()):
            found.append(name)
    return found


def test_k_train_has_one_name_in_identifiers():
    """K is num_speculative_tokens and K_train is num_depths in every key and identifier (config.json's
    `speculative_tokens` is the format's); the rule finds the old spellings."""
    assert k_train_identifiers("def k_train_of(cfg): return recommend(rows, allow_beyond_k_train=x.k_train)") == [
        "k_train_of", "allow_beyond_k_train", "k_train"]
    assert k_train_identifiers("def num_depths_of(cfg): return check_training_config(cfg.num_depths)") == []
    hits = {p.relative_to(PKG).as_posix(): k_train_identifiers(p.read_text()) for p in PKG.rglob("*.py")}
    assert not {k: v for k, v in hits.items() if v}


ROOT_MODULES = {"__init__", "config", "errors", "extras", "io", "logs", "options", "paths", "plan", "precision",
                "provenance", "runtime"}


def test_the_package_root_holds_shared_services_and_jobs_live_in_jobs():
    """No job module loose at the root again (a builder, the training job, the dry run and a sweep's
    summary are jobs/): the root holds the typed config, the planner and services every package uses."""
    assert {p.stem for p in PKG.glob("*.py")} == ROOT_MODULES
    assert {p.stem for p in (PKG / "jobs").glob("*.py")} == {"__init__", "builders", "training_job", "dry_run",
                                                             "sweep_summary"}


def test_aux_layer_rules_and_the_head_description_have_one_owner():
    """The old numbering, the default ids and the speculators keys of a head are named in one place
    each: target/aux_layers.py (AuxLayers) and draft/ (DraftConfig, DraftHead); no `rotary_emb`
    filter outside draft/base.py."""
    owners = {"OLD_AUX_LAYER_NUMBERING": {"target/aux_layers.py", "draft/head_config.py", "draft/head_files.py",
                                          "features/shards.py"},
              "[2, num_layers // 2, num_layers - 3]": {"target/aux_layers.py"},
              '"transformer_layer_config": ': {"draft/head_config.py"},
              '"rotary_emb.': {"draft/base.py"}}
    for text, allowed in owners.items():
        found = {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if text in p.read_text()}
        assert found <= allowed, (text, found - allowed)


DTYPE_NAMES = {"fp32", "bf16", "fp16", "float32", "bfloat16", "float16"}


def dtype_maps(source: str) -> list[int]:
    """Lines of the dict literals of `source` that are dtype-name maps: any holding a torch dtype
    (`torch.bfloat16`, ... as a key or a value, also inside a tuple), and any keyed by a dtype name
    with a number as its value (bytes per element)."""
    def items(node):
        for x in node.keys + node.values:
            yield from (x.elts if isinstance(x, ast.Tuple) else [x])

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Dict):
            continue
        torch_dtype = any(isinstance(x, ast.Attribute) and getattr(x.value, "id", None) == "torch"
                          and x.attr in DTYPE_NAMES | {"half", "float", "double", "float64"} for x in items(node))
        sized = any(isinstance(k, ast.Constant) and k.value in DTYPE_NAMES and isinstance(v, ast.Constant)
                    and type(v.value) is int for k, v in zip(node.keys, node.values))
        if torch_dtype or sized:
            found.append(node.lineno)
    return found


def test_one_dtype_name_map():
    """Names and dtypes are converted by one table, peagle_train/precision.py `DTYPE_NAMES` (with
    `dtype_of`, `dtype_name`, `short_name`): no other module writes its own dict of torch dtypes or of
    dtype names to bytes; a DeepSpeed config's "bf16": {...} is no such map."""
    toy = ('A = {"bfloat16": torch.bfloat16, "float32": torch.float32}\n'
           'B = {torch.bfloat16: "bf16"}\n'
           'C = {"bf16": {"enabled": False}, "fp16": {"enabled": False}}\n'
           'D = {None: 4, "float32": 4, "bfloat16": 2}\n'
           'E = {torch.float16: ("float16", "fp16")}\n'
           'F = (torch.bfloat16, torch.float16)\n')
    assert dtype_maps(toy) == [1, 2, 4, 5]
    found = {p.relative_to(PKG).as_posix(): lines for p in PKG.rglob("*.py") if (lines := dtype_maps(p.read_text()))}
    assert list(found) == ["precision.py"] and len(found["precision.py"]) == 1, found
