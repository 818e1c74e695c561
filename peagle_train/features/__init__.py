"""Packed training rows and where their features come from: the frozen target run online in the
training step, or offline shards written by `peagle features`. Both sources build
rows with the one packing function `rows.pack_row`."""

from .rows import PackedRow, pack_documents, pack_row
from .sources import FeatureSource, OnlineFeatures, open_features

__all__ = ["PackedRow", "pack_documents", "pack_row", "FeatureSource", "OnlineFeatures", "open_features"]
