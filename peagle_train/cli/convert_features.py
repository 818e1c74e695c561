"""Re-store an offline features directory in another dtype, without running the target.

    peagle convert-features features.dir=/tmp/feats-f32 output_dir=/tmp/feats-int8 storage=int8 [int8_scale=token]

The source's shards are verified (size, sha256) first; the new manifest keeps the source's
fingerprint except the storage. Train on it with features.source=offline features.dir=DST
features.storage=int8.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from omegaconf import MISSING

from peagle_train.runtime import cli_main


@dataclass
class Source:
    dir: str = MISSING       # the features directory to convert (`peagle features` wrote it)


@dataclass
class ConvertArgs:
    features: Source = field(default_factory=Source)
    output_dir: str = MISSING  # the new features directory
    storage: str = MISSING     # float32 | bfloat16 | int8
    int8_scale: str = "channel"  # channel | token (storage=int8)


def main(argv: list[str]) -> dict:
    """`peagle convert-features features.dir=SRC output_dir=DST storage=S [int8_scale=channel|token]`:
    `features.shards.convert_features` on the parsed arguments. Returns its summary dict. Raises
    ConfigError (bad arguments) and the errors of `convert_features` (a missing or damaged source)."""
    from peagle_train.cli import parse_pairs
    from peagle_train.features.shards import convert_features

    a = parse_pairs(argv, ConvertArgs, __doc__)
    return convert_features(a.features.dir, a.output_dir, a.storage, a.int8_scale)


def run(argv: list[str] | None = None) -> int:
    """`peagle convert-features key=value ...`; a user error is one line and exit status 2."""
    cli_main(main)(sys.argv[1:] if argv is None else list(argv))
    return 0
