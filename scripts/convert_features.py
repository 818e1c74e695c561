"""Re-store an offline features directory in another dtype, without running the target.

    python scripts/convert_features.py /tmp/feats-f32 /tmp/feats-int8 --storage int8 [--int8-scale token]

The source's shards are verified (size, sha256) first; the new manifest keeps the source's
fingerprint except the storage. Train on it with features.source=offline features.dir=DST
features.storage=int8.
"""

from __future__ import annotations

import argparse

from peagle_train.errors import cli_main
from peagle_train.target.offline import INT8_SCALES, STORAGES, convert_features

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--storage", choices=STORAGES, required=True)
    ap.add_argument("--int8-scale", choices=INT8_SCALES, default="channel")
    a = ap.parse_args()
    cli_main(convert_features)(a.src, a.dst, a.storage, a.int8_scale)  # a user error: one line, exit 2
