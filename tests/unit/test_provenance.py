"""Fingerprints, sha256 of files and atomic writes: one of each (peagle_train/provenance.py, io.py)."""

import hashlib
import json

import datasets
import numpy as np
import pytest

from peagle_train import provenance
from peagle_train.data.manifest import build_manifest, check_manifest, ManifestMismatchError
from peagle_train.io import atomic_dir, atomic_path, atomic_write_json, atomic_write_text
from peagle_train.target.capture import FeatureTarget
from peagle_train.features.shards import OfflineFeatures
from peagle_train.features.shards import FeatureShardError, features_fingerprint, write_features

ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256("abc"), FIPS 180-2 example


def test_digest_and_file_sha256(tmp_path):
    assert provenance.digest("abc") == ABC and provenance.digest(b"abc") == ABC
    assert provenance.digest("a", "b") == hashlib.sha256(b"a\0b").hexdigest()
    assert provenance.digest("ab", "c") != provenance.digest("a", "bc")
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    assert provenance.sha256_file(f) == ABC
    memo = tmp_path / "memo"
    assert provenance.sha256_file(f, memo_dir=memo) == ABC
    stored = json.loads((memo / "hashes.json").read_text())
    assert list(stored.values()) == [ABC]
    # the memo is what is read for an unchanged file ...
    (memo / "hashes.json").write_text(json.dumps({k: "remembered" for k in stored}))
    assert provenance.sha256_file(f, memo_dir=memo) == "remembered"
    # ... and a changed file (size) is hashed again
    f.write_bytes(b"abcd")
    assert provenance.sha256_file(f, memo_dir=memo) == hashlib.sha256(b"abcd").hexdigest()
    with pytest.raises(FileNotFoundError):
        provenance.sha256_file(tmp_path / "missing")


def test_rows_fingerprint_is_the_bytes_of_ids_and_masks():
    rows = {"input_ids": [[1, 2, 3], [4]], "loss_mask": [[0, 1, 1], [1]]}
    h = hashlib.sha256()
    for ids, m in zip(rows["input_ids"], rows["loss_mask"]):
        h.update(np.array(ids, np.int32).tobytes() + np.array(m, np.int8).tobytes() + b"|")
    assert provenance.rows_fingerprint(rows) == h.hexdigest()
    assert provenance.rows_fingerprint(datasets.Dataset.from_dict(rows)) == h.hexdigest()
    changed = {"input_ids": rows["input_ids"], "loss_mask": [[1, 1, 1], [1]]}
    assert provenance.rows_fingerprint(changed) != h.hexdigest()
    swapped = {"input_ids": rows["input_ids"][::-1], "loss_mask": rows["loss_mask"][::-1]}
    assert provenance.rows_fingerprint(swapped) != h.hexdigest()


def test_rows_fingerprint_of_a_dataset_read_as_arrow_equals_the_lists():
    """The Arrow path (a datasets.Dataset, read in batches of 1,024 rows) gives the digest of the rows
    as Python lists: across batch boundaries, under a shuffle + select (an indices mapping), with
    int64 ids, bool masks and an empty row."""
    g = np.random.default_rng(0)
    ids = [g.integers(0, 50_000, int(g.integers(0, 40))).tolist() for _ in range(2500)]
    rows = {"input_ids": ids, "loss_mask": [[bool(t % 3) for t in x] for x in ids]}
    ds = datasets.Dataset.from_dict(rows)
    assert provenance.rows_fingerprint(ds) == provenance.rows_fingerprint(rows)
    picked = ds.shuffle(seed=1).select(range(3, 2100))
    assert picked._indices is not None  # read through its indices mapping
    as_lists = {"input_ids": [r["input_ids"] for r in picked], "loss_mask": [r["loss_mask"] for r in picked]}
    assert provenance.rows_fingerprint(picked) == provenance.rows_fingerprint(as_lists)
    assert provenance.rows_fingerprint(picked) != provenance.rows_fingerprint(ds)


def test_tokenizer_and_template_fingerprints(chatml_tokenizer):
    tok = chatml_tokenizer
    fp = provenance.tokenizer_fingerprint(tok)
    blob = tok.backend_tokenizer.to_str()
    assert fp == hashlib.sha256(blob.encode()).hexdigest()
    tok.backend_tokenizer.enable_truncation(max_length=7)  # call-time state is not part of it, and is kept
    assert provenance.tokenizer_fingerprint(tok) == fp
    assert tok.backend_tokenizer.truncation["max_length"] == 7
    tok.backend_tokenizer.no_truncation()
    t0 = provenance.chat_template_fingerprint(tok)
    assert t0 == hashlib.sha256((tok.chat_template + "\0[]").encode()).hexdigest()
    assert provenance.chat_template_fingerprint(tok, {}) == t0
    off = provenance.chat_template_fingerprint(tok, {"enable_thinking": False, "x": 1})
    assert off != t0 and off == provenance.chat_template_fingerprint(tok, {"x": 1, "enable_thinking": False})
    assert off != provenance.chat_template_fingerprint(tok, {"enable_thinking": True, "x": 1})


def test_prepared_manifest_and_features_fingerprint_see_template_kwargs(tmp_path, target_model, chatml_tokenizer):
    tok = chatml_tokenizer
    m = build_manifest(sources=[], tokenizer=tok, template_kwargs={"enable_thinking": False}, target_vocab_size=128,
                       max_length=64, min_supervised_tokens=1, draft_ids=[1, 2], coverage=1.0, mask_token_id=127,
                       mask_token_source="test", counts={})
    assert m["tokenizer"]["sha256"] == provenance.tokenizer_fingerprint(tok)
    assert m["draft_vocab"]["sha256"] == hashlib.sha256(b"[1, 2]").hexdigest()
    check_manifest(m, tok, 128, template_kwargs={"enable_thinking": False})
    with pytest.raises(ManifestMismatchError, match="chat template sha256"):
        check_manifest(m, tok, 128, template_kwargs={})
    # the offline features manifest: same tokenizer and template fingerprints, template_kwargs included
    t = FeatureTarget(target_model, [1, 3, 5])
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10]], "loss_mask": [[0, 0, 1, 1, 1, 1]]})
    fp = features_fingerprint(t, tok, rows, "float32", template_kwargs={"enable_thinking": False})
    assert fp["tokenizer"] == m["tokenizer"]["sha256"]
    assert fp["template"] == m["chat_template"]["sha256"]
    assert fp["data"] == provenance.rows_fingerprint(rows) and fp["target"] == provenance.weights_fingerprint(target_model)
    write_features(t, tok, rows, tmp_path / "f", storage="float32", template_kwargs={"enable_thinking": False})
    OfflineFeatures(tmp_path / "f", t, tok, rows, template_kwargs={"enable_thinking": False})
    with pytest.raises(FeatureShardError, match="template"):
        OfflineFeatures(tmp_path / "f", t, tok, rows)  # rendered without the kwargs
    shard = tmp_path / "f" / "shard-00000.safetensors"
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert manifest["shards"]["0"]["sha256"] == provenance.sha256_file(shard)
    assert not list((tmp_path / "f").glob("*.tmp*"))


def test_atomic_file_writes(tmp_path):
    p = tmp_path / "sub" / "a.json"
    atomic_write_json(p, {"x": 1})
    assert json.loads(p.read_text()) == {"x": 1}
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert json.loads(p.read_text()) == {"x": 1}  # the old content stays
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.json"]  # no temporary left
    atomic_write_text(p, "new", durable=True)
    assert p.read_text() == "new"


def test_atomic_dir(tmp_path):
    d = tmp_path / "export"
    with atomic_dir(d) as tmp:
        assert tmp.parent == tmp_path and tmp != d and not d.exists()
        (tmp / "f").write_text("1")
    assert (d / "f").read_text() == "1"
    with pytest.raises(FileExistsError):
        with atomic_dir(d):
            pass
    with pytest.raises(ValueError):
        with atomic_dir(d, overwrite=True) as tmp:
            (tmp / "f").write_text("2")
            raise ValueError("validation failed")
    assert (d / "f").read_text() == "1" and sorted(x.name for x in tmp_path.iterdir()) == ["export"]
    with atomic_dir(d, overwrite=True, durable=True) as tmp:
        (tmp / "g").write_text("3")
    assert sorted(x.name for x in d.iterdir()) == ["g"]
    # another process finishes the same directory first: its version is kept, ours discarded
    race = tmp_path / "cache"
    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        with atomic_dir(race) as tmp:
            (tmp / "mine").write_text("x")
            race.mkdir()
            (race / "theirs").write_text("y")
    assert sorted(x.name for x in race.iterdir()) == ["theirs"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["cache", "export"]
