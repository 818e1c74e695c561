"""A GGUF target is dequantised once per file content (target/load.py `_dequantised_gguf_dir`): the
same bytes installed in two virtual environments share one cached copy; other bytes get their own."""

import hashlib

from peagle_train.target import load


def test_one_dequantised_copy_per_gguf_content(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "CACHE_DIR", tmp_path / "cache")
    a, b = tmp_path / "venv-a" / "m.gguf", tmp_path / "venv-b" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF same bytes")
    want = tmp_path / "cache" / f"m-{hashlib.sha256(b'GGUF same bytes').hexdigest()[:16]}"
    want.mkdir(parents=True)
    (want / "config.json").write_text("{}")  # a finished copy: returned without dequantising
    (want / "model.safetensors").write_bytes(b"")
    assert load._dequantised_gguf_dir(a) == load._dequantised_gguf_dir(b) == want
    b.write_bytes(b"GGUF other bytes")
    other = load.CACHE_DIR / f"m-{hashlib.sha256(b'GGUF other bytes').hexdigest()[:16]}"
    (other).mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"")
    assert load._dequantised_gguf_dir(b) == other
