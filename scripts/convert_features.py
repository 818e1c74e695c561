"""Re-store an offline features directory in another dtype, without running the target.

    python scripts/convert_features.py features.dir=/tmp/feats-f32 output_dir=/tmp/feats-int8 storage=int8 [int8_scale=token]

The source's shards are verified (size, sha256) first; the new manifest keeps the source's
fingerprint except the storage. Train on it with features.source=offline features.dir=DST
features.storage=int8.
"""

import sys
from dataclasses import dataclass, field

from omegaconf import MISSING

from peagle_train.cli import parse_pairs
from peagle_train.errors import cli_main
from peagle_train.features.shards import convert_features


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
    a = parse_pairs(argv, ConvertArgs, __doc__)
    return convert_features(a.features.dir, a.output_dir, a.storage, a.int8_scale)


if __name__ == "__main__":
    cli_main(main)(sys.argv[1:])  # a user error: one line, exit 2
