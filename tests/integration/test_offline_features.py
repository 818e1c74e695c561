"""Offline feature shards equal online features, resume, 8-bit storage, bad input, Gemma-3."""

import contextlib
import json
from pathlib import Path

import datasets
import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from peagle_train import provenance
import peagle_train.features.shards as offline
from peagle_train.data.vocab import DraftVocab
from peagle_train.jobs.builders import build_draft
from peagle_train.config import default_config
from peagle_train.target.capture import FeatureTarget
from peagle_train.features.shards import OfflineFeatures
from peagle_train.features.online import packed_row
from peagle_train.features.rows import TargetLogitsAt
from peagle_train.features.shards import (FeatureShardError, convert_features, dequantize_int8, quantize_int8,
                                         write_features)
from peagle_train.training.checks import TrainSettings
from peagle_train.training.trainer import train

from ..conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 120, (int(torch.randint(12, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0] * 4 + [1] * (len(x) - 4) for x in ids]})


@pytest.fixture
def setup(tmp_path, target_model, chatml_tokenizer):
    t = FeatureTarget(target_model, [1, 3, 5])
    data = rows()
    write_features(t, chatml_tokenizer, data, tmp_path / "f32", storage="float32", docs_per_shard=3)
    return t, chatml_tokenizer, data, tmp_path / "f32"


def test_offline_rows_equal_online_rows(setup):
    t, tok, data, d = setup
    assert sorted(p.name for p in d.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                         "shard-00002.safetensors"]  # 7 docs, 3 per shard
    reader = OfflineFeatures(d, t, tok, data)
    draft_ids = torch.arange(0, 128, 2)
    idx = [6, 1, 3]  # across shards, out of order
    docs = [(data[i]["input_ids"], data[i]["loss_mask"]) for i in idx]
    a, b = reader.packed_row(idx, docs, draft_ids), packed_row(t, docs, draft_ids)
    for name in ("tokens", "features", "target_logits", "valid", "doc_ids", "pos_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # computed where indexed (an objective that reads few positions): the same logits at those positions
    lazy = reader.packed_row(idx, docs, draft_ids, lazy_targets=contextlib.nullcontext())
    assert isinstance(lazy.target_logits, TargetLogitsAt) and len(lazy.target_logits) == b.tokens.numel()
    at = torch.tensor([0, 5, 5, len(lazy.target_logits) - 1])
    torch.testing.assert_close(lazy.target_logits[at], b.target_logits[at], rtol=1e-6, atol=1e-6)
    assert not lazy.target_logits[at].requires_grad
    for name in ("tokens", "features", "valid", "doc_ids", "pos_ids"):
        assert torch.equal(getattr(lazy, name), getattr(b, name)), name


@pytest.mark.parametrize("algorithm", ["peagle", "dflash"])
def test_offline_training_gives_the_online_losses(tmp_path, setup, algorithm):
    """float32 shards give the online run's losses: P-EAGLE's bit for bit; DFlash's (its target
    logits computed only at its blocks' labels, `TargetLogitsAt`) to float rounding."""
    t, tok, data, d = setup
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": True, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False})
    train_cfg = TrainSettings(OmegaConf.merge(default_config().training,
                                              {"tokens_per_step": 48, "epochs": 2, "lr": 3e-3, "warmup_steps": 1,
                                               "max_anchors": 16}), draft=dcfg, algorithm=algorithm, seed=0)
    losses = {}
    for mode, feats in (("online", None), ("offline", OfflineFeatures(d, t, tok, data))):
        torch.manual_seed(0)
        draft = build_draft(t, dcfg, vocab, 127, algorithm)
        (tmp_path / mode).mkdir()
        train(Accelerator(cpu=True), draft, t, data, vocab.draft_ids, train_cfg, tmp_path / mode, features=feats)
        losses[mode] = [json.loads(x)["loss"] for x in (tmp_path / mode / "train_log.jsonl").read_text().splitlines()]
    assert len(losses["online"]) >= 4
    if algorithm == "peagle":
        assert losses["offline"] == losses["online"]  # float32 shards: bit-identical steps
    else:
        assert losses["offline"] == pytest.approx(losses["online"], rel=1e-5)


@pytest.mark.parametrize("mode", ["channel", "token"])
def test_int8_quantisation_round_trip(mode):
    x = torch.randn(50, 12) * torch.tensor([1.0, 10, 100] * 4)
    x[0] *= 30  # an outlier token
    q, s = quantize_int8(x, 3, mode)
    assert q.dtype == torch.int8 and s.shape == ((12,) if mode == "channel" else (50, 3))
    err = (dequantize_int8(q, s) - x).abs()
    bound = (s / 2)[None].expand_as(x) if mode == "channel" else (s / 2).repeat_interleave(4, 1)
    assert (err <= bound * 1.0001 + 1e-6).all()  # at most half a step
    assert torch.equal(quantize_int8(torch.tensor([[127.0, -63.5, 0.4]]), 1, "token")[0], torch.tensor([[127, -64, 0]],
                                                                                                           dtype=torch.int8))


def test_int8_shards_halve_bf16_and_stay_close(tmp_path, setup):
    t, tok, data, d = setup
    sizes = {}
    for storage in ("bfloat16", "int8"):
        s = write_features(t, tok, data, tmp_path / storage, storage=storage, docs_per_shard=3)
        sizes[storage] = s["bytes"]
    H = t.config.hidden_size
    n_tok = sum(len(x) for x in data["input_ids"])
    # features: bf16 8H bytes/token, int8 4H bytes/token (+ 4H fp32 scales per shard); ids are int32 in both
    feat_bf16, feat_int8 = sizes["bfloat16"] - 4 * n_tok, sizes["int8"] - 4 * n_tok
    assert feat_int8 <= 0.5 * feat_bf16 + 3 * (4 * 4 * H + 400)  # per shard: scales + 2 more header entries
    for storage in ("bfloat16", "int8"):  # converting the float32 shards gives the same files, byte for byte
        convert_features(d, tmp_path / f"conv-{storage}", storage)
        for k in range(3):
            name = f"shard-{k:05d}.safetensors"
            assert (tmp_path / f"conv-{storage}" / name).read_bytes() == (tmp_path / storage / name).read_bytes()
        OfflineFeatures(tmp_path / f"conv-{storage}", t, tok, data)
    r8 = OfflineFeatures(tmp_path / "int8", t, tok, data)
    ref = OfflineFeatures(d, t, tok, data)
    _, aux8, fin8 = r8.document(2)
    _, aux, fin = ref.document(2)
    assert ((aux8 - aux).norm() / aux.norm()) < 0.02 and ((fin8 - fin).norm() / fin.norm()) < 0.02


def test_resume_after_interruption_recomputes_only_missing_shards(tmp_path, setup, monkeypatch):
    t, tok, data, _ = setup
    real_save, calls = offline.save_file, []

    def dying_save(tensors, path):
        if len(calls) == 1:  # killed while writing the second shard (the temp file is half written)
            open(path, "wb").write(b"partial")
            raise KeyboardInterrupt
        calls.append(path)
        real_save(tensors, path)

    monkeypatch.setattr(offline, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        write_features(t, tok, data, tmp_path / "r", storage="bfloat16", docs_per_shard=3)
    monkeypatch.setattr(offline, "save_file", real_save)
    forwards = []
    orig = FeatureTarget.forward
    monkeypatch.setattr(FeatureTarget, "__call__", lambda self, ids, **kw: forwards.append(ids.shape[1]) or orig(self, ids, **kw))
    s = write_features(t, tok, data, tmp_path / "r", storage="bfloat16", docs_per_shard=3)
    assert (s["shards_written"], s["shards_skipped"]) == (2, 1)
    # docs 0-2 (shard 0) not recomputed; one forward per shard's packed documents: shard 1 = docs 3-5, shard 2 = doc 6
    assert forwards == [sum(len(data[i]["input_ids"]) for i in range(3, 6)), len(data[6]["input_ids"])]
    assert not list((tmp_path / "r").glob("*.tmp*"))
    OfflineFeatures(tmp_path / "r", t, tok, data)  # complete and verified
    shard1 = tmp_path / "r" / "shard-00001.safetensors"
    good = shard1.read_bytes()
    shard1.write_bytes(good[:100])  # damaged after writing: a rerun recomputes just that shard
    s = write_features(t, tok, data, tmp_path / "r", storage="bfloat16", docs_per_shard=3)
    assert (s["shards_written"], s["shards_skipped"]) == (1, 2) and shard1.read_bytes() == good


def test_truncated_or_altered_shard_is_named(setup):
    t, tok, data, d = setup
    shard = d / "shard-00001.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-10])
    with pytest.raises(FeatureShardError, match=r"shard-00001\.safetensors: truncated.*check: size"):
        OfflineFeatures(d, t, tok, data)
    shard.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(FeatureShardError, match=r"shard-00001\.safetensors: altered.*sha256"):
        OfflineFeatures(d, t, tok, data)
    (d / "shard-00002.safetensors").unlink()
    shard.write_bytes(raw)
    with pytest.raises(FeatureShardError, match=r"shard-00002\.safetensors: missing"):
        OfflineFeatures(d, t, tok, data)


def test_manifest_of_another_target_or_layer_set_is_refused(setup):
    t, tok, data, d = setup
    with pytest.raises(FeatureShardError, match=r"manifest\.json: fingerprint check failed \(target\b"):
        OfflineFeatures(d, FeatureTarget(tiny_llama(seed=1), [1, 3, 5]), tok, data)
    with pytest.raises(FeatureShardError, match=r"fingerprint check failed \(aux_layer_ids differ\)"):
        OfflineFeatures(d, FeatureTarget(t.model, [1, 3, 6]), tok, data)
    with pytest.raises(FeatureShardError, match=r"fingerprint check failed \(storage"):
        OfflineFeatures(d, t, tok, data, storage="int8")
    with pytest.raises(FeatureShardError, match="fingerprint check failed"):  # and the writer refuses to mix
        write_features(t, tok, data, d, storage="bfloat16", docs_per_shard=3)


def test_data_row_with_other_tokens_is_named(setup):
    t, tok, data, d = setup
    ids = list(data["input_ids"])
    ids[4] = ids[4][:-1] + [(ids[4][-1] + 1) % 120]
    changed = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": data["loss_mask"]})
    with pytest.raises(FeatureShardError, match=r"shard-00001\.safetensors: document 1 \(data row 4\).*check: token ids"):
        OfflineFeatures(d, t, tok, changed)
    reader = OfflineFeatures(d, t, tok, data)  # a batch whose row differs from the shard's
    with pytest.raises(FeatureShardError, match=r"shard-00001\.safetensors: data row 4.*token ids"):
        reader.packed_row([4], [(ids[4], data[4]["loss_mask"])], torch.arange(128))


def test_nan_features_are_refused_at_write_and_read(tmp_path, setup, monkeypatch):
    t, tok, data, d = setup
    # read: a shard rewritten with a NaN (and a matching checksum, so only the finiteness check can catch it)
    from safetensors.torch import load_file, save_file

    path = d / "shard-00002.safetensors"
    x = load_file(str(path))
    x["aux"][3, 5] = float("nan")
    save_file(x, str(path))
    m = json.loads((d / "manifest.json").read_text())
    m["shards"]["2"].update(bytes=path.stat().st_size, sha256=provenance.sha256_file(path))
    (d / "manifest.json").write_text(json.dumps(m))
    reader = OfflineFeatures(d, t, tok, data)
    with pytest.raises(FeatureShardError, match=r"shard-00002\.safetensors: document 0 \(data row 6\).*NaN/Inf"):
        reader.packed_row([6], [(data[6]["input_ids"], data[6]["loss_mask"])], torch.arange(128))
    # write: the target gives NaN for a row
    with torch.no_grad():
        t.model.model.layers[3].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(FeatureShardError, match=r"data row 0 \(shard shard-00000\.safetensors\).*NaN/Inf"):
        write_features(t, tok, data, tmp_path / "nan", storage="bfloat16", docs_per_shard=3)


def test_gemma3_capture_and_offline_logits():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                           sliding_window=4, final_logit_softcapping=30.0)
    model = Gemma3ForCausalLM(cfg).eval().requires_grad_(False)
    t = FeatureTarget(model)
    assert t.aux_layer_ids == [2, 4, 5]
    ids = torch.randint(0, 96, (1, 13))
    ref = model(ids, output_hidden_states=True)
    out = t(ids)
    for j, layer in enumerate(t.aux_layer_ids):  # id k = hidden_states[k] (vLLM's numbering)
        torch.testing.assert_close(out.aux[..., j * 32:(j + 1) * 32], ref.hidden_states[layer], rtol=0, atol=0)
    out0 = FeatureTarget(model, [0, 3, 7])(ids)  # id 0: the embeddings with Gemma's sqrt(H) scale
    for j, layer in enumerate([0, 3, 7]):
        torch.testing.assert_close(out0.aux[..., j * 32:(j + 1) * 32], ref.hidden_states[layer], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)  # incl. Gemma's (1 + w) norm, softcap
    torch.testing.assert_close(t.logits_from_final(out.final), ref.logits, rtol=1e-5, atol=1e-5)


def test_offline_int8_training_validates_on_int8_features(tmp_path, setup, monkeypatch):
    """Validation reads the training feature source: an int8 run never runs the target's decoder,
    and its validation loss/EAL are those of the int8 rows, not of the online features."""
    from peagle_train.algorithms import make_objective
    from peagle_train.features.rows import pack_documents, split_validation
    from peagle_train.features.online import OnlineFeatures

    t, tok, data, _ = setup
    write_features(t, tok, data, tmp_path / "i8", storage="int8", int8_scale="token", docs_per_shard=3)
    reader = OfflineFeatures(tmp_path / "i8", t, tok, data, int8_scale="token")
    vocab = DraftVocab.from_ids(torch.arange(0, 128, 2), 128)
    dcfg = OmegaConf.create({"num_layers": 1, "num_depths": 3, "norm_before_fc": True, "fc_norm": False,
                             "norm_before_residual": False, "gradient_checkpointing": False})
    train_cfg = TrainSettings(OmegaConf.merge(default_config().training,
                                              {"tokens_per_step": 48, "epochs": 2, "lr": 3e-3, "warmup_steps": 1,
                                               "max_anchors": 16, "val_conversations": 2, "save_every": 2}),
                              draft=dcfg, algorithm="peagle", seed=0)
    torch.manual_seed(0)
    draft = build_draft(t, dcfg, vocab, 127)

    def no_decoder(*a, **k):
        raise AssertionError("the target's decoder ran in an offline run")

    monkeypatch.setattr(FeatureTarget, "forward", no_decoder)
    res = train(Accelerator(cpu=True), draft, t, data, vocab.draft_ids, train_cfg, tmp_path / "run", features=reader)
    monkeypatch.undo()
    val = res["validation"]
    _, val_idx = split_validation(len(data), 2, 0)
    batches = [[val_idx[j] for j in b] for b in pack_documents([len(data[i]["input_ids"]) for i in val_idx], 48, 0)]
    obj = make_objective(train_cfg.algorithm, train_cfg.training, train_cfg.num_depths)
    head = res["draft"].eval()

    def val_loss(source):
        sums = [0.0, 0.0]
        for i, b in enumerate(batches):
            row = source.packed_row(b, [(data[j]["input_ids"], data[j]["loss_mask"]) for j in b], vocab.draft_ids)
            ls, c, _ = obj.validate_row(head, row, torch.Generator().manual_seed(0 * 1000 + 99991 + i))
            sums = [sums[0] + ls, sums[1] + c]
        return sums[0] / sums[1]

    assert val["val_loss"] == pytest.approx(val_loss(reader), rel=1e-6)
    assert abs(val_loss(OnlineFeatures(t)) - val["val_loss"]) > 1e-6  # int8 features differ from the target's


def test_each_process_hashes_its_share_of_the_shards(setup, monkeypatch):
    """Rank 1 of 2 hashes shard 1 only (shards k with k mod 2 = 1), not all three."""
    import peagle_train.features.shards as shards

    t, tok, data, d = setup
    hashed, real = [], shards.provenance.sha256_file
    monkeypatch.setattr(shards.provenance, "sha256_file", lambda p: (hashed.append(Path(p).name), real(p))[1])
    monkeypatch.setattr(shards, "process_share", lambda: (1, 2))
    monkeypatch.setattr(shards, "agree_on_shards", lambda problem: None)
    OfflineFeatures(d, t, tok, data)
    assert hashed == ["shard-00001.safetensors"]


def test_a_damaged_shard_stops_every_process(setup, tmp_path):
    """Shard 1 altered (same size): only rank 1 hashes it, and both ranks of a 2-process gloo group
    refuse the features, rank 0 naming rank 1's finding, instead of rank 0 training alone."""
    import torch.multiprocessing as mp

    t, tok, data, d = setup
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(str(tok_dir))
    shard = d / "shard-00001.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    mp.spawn(_open_with_saved_tokenizer, args=(2, str(tmp_path / "store"), str(d), str(tmp_path), str(tok_dir)),
             nprocs=2, join=True)
    r0, r1 = (tmp_path / "rank0.txt").read_text(), (tmp_path / "rank1.txt").read_text()
    assert "shard-00001.safetensors: altered" in r1 and "sha256" in r1
    assert r0.startswith("process 1 found a damaged feature shard: ") and "shard-00001.safetensors: altered" in r0


def _open_with_saved_tokenizer(rank, world, store_file, d, out, tok_dir):
    import torch.distributed as dist
    from transformers import AutoTokenizer

    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    t = FeatureTarget(tiny_llama(), [1, 3, 5])
    try:
        OfflineFeatures(d, t, AutoTokenizer.from_pretrained(tok_dir), rows())
        msg = "opened"
    except FeatureShardError as e:
        msg = str(e)
    Path(out, f"rank{rank}.txt").write_text(msg)
    dist.destroy_process_group()


def test_an_engine_prepares_the_shards_a_job_at_a_time(tmp_path, setup):
    """An external engine (DocFeatures) is asked for at most tokens_per_job tokens of rows per job,
    shard by shard in order, each job before its shards' rows are read; the shards equal the
    in-process target's bit for bit."""
    from peagle_train.features.shards import DocFeatures

    t, tok, data, d = setup
    lengths = [len(x) for x in data["input_ids"]]
    events = []

    class Engine(DocFeatures):
        def prepare(self, indices):
            events.append(("prepare", list(indices)))

        def __call__(self, indices):
            events.append(("read", list(indices)))
            return [(o.aux[0], o.final[0]) for o in
                    t.forward_documents([torch.tensor(data[i]["input_ids"]) for i in indices], logits=False)]

    budget = sum(lengths[:6])  # shards 0 and 1 (rows 0-5) fit, shard 2 (row 6) starts a second job
    write_features(t, tok, data, tmp_path / "eng", storage="float32", docs_per_shard=3, doc_features=Engine(),
                   tokens_per_job=budget)
    jobs = [e[1] for e in events if e[0] == "prepare"]
    assert jobs == [[0, 1, 2, 3, 4, 5], [6]]
    assert events.index(("prepare", [6])) > max(i for i, e in enumerate(events) if e[0] == "read" and 5 in e[1])
    for k in range(3):
        name = f"shard-0000{k}.safetensors"
        assert (tmp_path / "eng" / name).read_bytes() == (d / name).read_bytes()


def test_a_vllm_job_is_budgeted_in_bytes_of_hidden_states(tmp_path, setup):
    """features.bytes_per_job (16 GiB) becomes tokens of rows per job from the engine's hidden size,
    states and dtype: an 8B-shaped engine (hidden 4,096, 3 aux + final, bfloat16: 32,768 bytes a
    token) gets 524,288 tokens (4M staged 131 GB), a tiny one (hidden 64: 512 bytes) 64× as many;
    the shards' split follows, and the old key is refused naming the new one."""
    from peagle_train.cli.command_line import check_command_line
    from peagle_train.features.shards import DocFeatures, _prepare_jobs, job_tokens, write_features_from_config
    from peagle_train.serving.vllm_engine import VllmDocFeatures

    assert default_config().features.bytes_per_job == 16 * 2**30
    big = VllmDocFeatures(rows(), "t", [2, 16, 29], 32, python="py", storage_dir=tmp_path, hidden_size=4096)
    tiny = VllmDocFeatures(rows(), "t", [1, 3, 5], 8, python="py", storage_dir=tmp_path, hidden_size=64)
    assert (big.bytes_per_token, tiny.bytes_per_token) == (4 * 4096 * 2, 4 * 64 * 2) == (32768, 512)
    assert VllmDocFeatures(rows(), "t", [1, 3, 5], 8, python="py", storage_dir=tmp_path, hidden_size=64,
                           dtype="float32").bytes_per_token == 1024
    assert job_tokens(16 * 2**30, 32768) == 524_288 and job_tokens(16 * 2**30, 512) == 33_554_432 == 64 * 524_288
    # 12 rows of 10 tokens, 2 rows a shard; 1,310,720 bytes = 40 tokens at 8B (2 shards a job), 2,560 tiny (one job)
    lengths, budget = [10] * 12, 40 * 32768
    assert _prepare_jobs(list(range(6)), lengths, 2, job_tokens(budget, 32768)) == \
        {0: [0, 1, 2, 3], 2: [4, 5, 6, 7], 4: [8, 9, 10, 11]}
    assert _prepare_jobs(list(range(6)), lengths, 2, job_tokens(budget, 512)) == {0: list(range(12))}

    t, tok, data, _ = setup  # through the config: the engine's jobs cut at bytes_per_job / bytes_per_token
    lengths = [len(x) for x in data["input_ids"]]
    for per_token in (32768, 512):
        jobs = []

        class Engine(DocFeatures):
            bytes_per_token = per_token

            def prepare(self, indices):
                jobs.append(list(indices))

            def __call__(self, indices):
                return [(o.aux[0], o.final[0]) for o in
                        t.forward_documents([torch.tensor(data[i]["input_ids"]) for i in indices], logits=False)]

        fcfg = OmegaConf.create({"dir": str(tmp_path / f"b{per_token}"), "storage": "float32",
                                 "int8_scale": "channel", "docs_per_shard": 3,
                                 "bytes_per_job": sum(lengths[:6]) * 32768})
        write_features_from_config(fcfg, t, tok, data, doc_features=Engine())
        assert jobs == ([[0, 1, 2, 3, 4, 5], [6]] if per_token == 32768 else [list(range(7))])
    (err,) = check_command_line(["features.tokens_per_job=4000000"])
    assert err.startswith("features.tokens_per_job was removed") and "Fix: features.bytes_per_job=" in err


def test_draft_vocabulary_rows_of_the_lm_head_follow_the_weight_and_the_ids(target_model):
    """logits_from_final gathers the lm_head rows of the draft vocabulary once, and again when the
    ids or the weight change (in place, or .data swapped): always equal to the plain expression."""
    t = FeatureTarget(target_model, [1, 3, 5])
    final = torch.randn(4, target_model.config.hidden_size)
    w = target_model.get_output_embeddings().weight

    def plain(ids):
        with torch.no_grad():
            return (t.decoder.norm(final) @ w[ids].T).float()

    ids = torch.arange(0, 128, 2)
    with torch.no_grad():
        assert torch.equal(t.logits_from_final(final, ids), plain(ids))
        cached = t._draft_rows_cache[3]
        assert torch.equal(t.logits_from_final(final, ids), plain(ids)) and t._draft_rows_cache[3] is cached
        other = torch.arange(1, 128, 2)
        assert torch.equal(t.logits_from_final(final, other), plain(other))
        old = w.detach().clone()
        w.mul_(2.0)                                                  # in place
        assert torch.equal(t.logits_from_final(final, other), plain(other))
        w.data = old                                                 # storage swapped
        assert torch.equal(t.logits_from_final(final, other), plain(other))
