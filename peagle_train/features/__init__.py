"""Packed training rows and where their features come from: the frozen target run online in the
training step, or offline shards written by `peagle features`. Both sources build
rows with the one packing function `rows.pack_row`."""

from ..errors import ConfigError
from ..target.capture import FeatureTarget
from .shards import OfflineFeatures
from .rows import PackedRow, pack_documents, pack_row
from .online import PackedRowSource, OnlineFeatures

__all__ = ["PackedRow", "pack_documents", "pack_row", "PackedRowSource", "OnlineFeatures", "OfflineFeatures", "open_features"]


def open_features(fcfg, target: FeatureTarget, tok, rows, template_kwargs: dict | None = None) -> PackedRowSource:
    """From the `features` config group: `OnlineFeatures` for `source=online` (the training step runs
    the target), an `OfflineFeatures` reader for `source=offline`. Raises ConfigError (a ValueError) for an unknown
    source or a missing `features.dir`, FeatureShardError for a directory that fails its checks.
    `template_kwargs` (data.template_kwargs) are part of the chat-template fingerprint the shards must match."""
    if fcfg.source == "online":
        return OnlineFeatures(target)
    if fcfg.source != "offline":
        raise ConfigError(f"features.source={fcfg.source!r} must be online or offline")
    if not fcfg.dir:
        raise ConfigError("features.source=offline needs features.dir (written by `peagle features`)")
    return OfflineFeatures(fcfg.dir, target, tok, rows, storage=fcfg.storage, int8_scale=fcfg.int8_scale,
                           verify=fcfg.verify, template_kwargs=template_kwargs)
