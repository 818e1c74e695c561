"""The DFlash head and objective: the block mask and labels by hand, the batched training forward
against a per-block reference written from the layer equations, gradients against that reference,
training equals decoding, the decoding engine is lossless, the head learns."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from peagle_train.algorithms.dflash import DFlashObjective, dflash_blocks, dflash_forward, dflash_loss, dflash_mask
from peagle_train.decoding.engine import generate
from peagle_train.draft.kv_cache import SlotCache
from peagle_train.draft.dflash import DFlashDraft
from peagle_train.draft import DraftConfig, make_draft_head
from peagle_train.features.rows import PackedRow
from peagle_train.target.capture import FeatureTarget
from peagle_train.algorithms.loss import LOSSES

from ..reference_decoder import target_generate
from .test_training import random_row


def make_dflash(target_model, K=4, layers=2, seed=0, causal=False, window=None):
    torch.manual_seed(seed)
    t = FeatureTarget(target_model)
    ids = torch.arange(0, 128, 2)
    cfg = DraftConfig.from_target(target_model.config, num_layers=layers, draft_vocab_size=64, mask_token_id=127,
                                  num_depths=K, aux_layer_ids=t.aux_layer_ids, algorithm="dflash", block_causal=causal,
                                  sliding_window=window)
    d = make_draft_head(cfg).eval()
    assert isinstance(d, DFlashDraft)
    d.init_from_target(target_model, ids, ids - torch.arange(64), torch.zeros(128, dtype=torch.bool).index_fill_(0, ids, True))
    with torch.no_grad():  # a head that is not the identity of its init: norms and embeddings perturbed
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return t, d


# ---- by hand ------------------------------------------------------------------------------------

def test_mask_by_hand():
    """Row of 5 positions in documents [0, 0, 0, 1, 1]; blocks at anchors 1 and 3, K = 1 (2 entries
    each). Keys: context 0..4, then block 0 (entries 5, 6), block 1 (entries 7, 8)."""
    doc = torch.tensor([0, 0, 0, 1, 1])
    m = dflash_mask(torch.tensor([1, 3]), doc, 1)
    want = torch.tensor([
        # c0 c1 c2 c3 c4 | b0 b0 | b1 b1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],   # block 0 (anchor 1), anchor entry
        [1, 1, 0, 0, 0, 1, 1, 0, 0],   # block 0, mask slot: non-causal, sees its whole block
        [0, 0, 0, 1, 0, 0, 0, 1, 1],   # block 1 (anchor 3): its document starts at 3
        [0, 0, 0, 1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, want)
    causal = dflash_mask(torch.tensor([1, 3]), doc, 1, causal=True)
    want[0, 6] = want[2, 8] = False     # the anchor entry no longer sees the slot after it
    assert torch.equal(causal, want)


def test_sliding_window_mask_by_hand():
    """Documents [0, 0, 1, 1, 1] at positions [0, 1, 0, 1, 2]; blocks at anchors 1 and 4, K = 1.
    Window 3: slot s of the block at anchor a sits at q = pos[a] + 1 + s and sees context at
    positions > q - 3. Window 1, causal: each entry sees only itself (every context position is
    at least 1 behind the anchor's query)."""
    doc, pos = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1, 0, 1, 2])
    m = dflash_mask(torch.tensor([1, 4]), doc, 1, window=3, pos_ids=pos)
    want = torch.tensor([
        # c0 c1 c2 c3 c4 | b0 b0 | b1 b1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],   # anchor 1, q = 2: c0 (2 - 0 < 3) and c1
        [0, 1, 0, 0, 0, 1, 1, 0, 0],   # its slot, q = 3: c0 is 3 behind
        [0, 0, 0, 1, 1, 0, 0, 1, 1],   # anchor 4, q = 3: c2 (position 0) is 3 behind
        [0, 0, 0, 0, 1, 0, 0, 1, 1],   # its slot, q = 4: only c4 (position 2)
    ], dtype=torch.bool)
    assert torch.equal(m, want)
    one = dflash_mask(torch.tensor([1, 4]), doc, 1, causal=True, window=1, pos_ids=pos)
    assert torch.equal(one, torch.cat([torch.zeros(4, 5, dtype=torch.bool),
                                       torch.eye(4, dtype=torch.bool)], 1))
    with pytest.raises(ValueError, match="pos_ids"):
        dflash_mask(torch.tensor([1]), doc, 1, window=3)


def test_blocks_by_hand():
    """valid [1, 0, 1, 1, 0, 1] over documents [0, 0, 0, 0, 1, 1], K = 2: slot j of anchor a is
    scored at row position a + j - 1 when that lies in a's document and is valid."""
    valid = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    doc = torch.tensor([0, 0, 0, 0, 1, 1])
    b = dflash_blocks(valid, doc, 2, None)
    # a=0: labels 0 (valid), 1 (invalid); a=1: 1 (no), 2 (yes); a=2: 2, 3; a=3: 3, 4 (other doc);
    # a=4: 4 (invalid), 5 (valid); a=5: 5, 6 (outside the row)
    assert b.anchors.tolist() == [0, 1, 2, 3, 4, 5]
    assert b.labels.tolist() == [[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 5]]
    assert b.valid.tolist() == [[True, False], [False, True], [True, True], [True, False], [False, True],
                                [True, False]]
    none = dflash_blocks(torch.tensor([0, 0, 1], dtype=torch.bool), torch.tensor([0, 0, 1]), 1, None)
    assert none.anchors.tolist() == [2]
    capped = dflash_blocks(valid, doc, 2, 3, torch.Generator().manual_seed(0))
    assert capped.anchors.numel() == 3 and capped.anchors.tolist() == sorted(capped.anchors.tolist())


# ---- a per-block reference written from the layer equations --------------------------------------

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, d):
    """Rotate-half RoPE (neox style, vLLM's `is_neox_style` default) of x [n, heads, d] at pos [n]."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block_logits(d: DFlashDraft, context: torch.Tensor, context_pos: torch.Tensor, block: torch.Tensor,
                           block_pos: torch.Tensor, causal: bool = False, window: int | None = None) -> torch.Tensor:
    """One block, no mask tensor: the context entries [S, 3H] at context_pos [S] and the block
    tokens [N] at block_pos [N], every layer's attention a plain softmax over exactly the keys the
    block may see (with `window`, only keys at positions > the query's - window). Returns logits
    [N, V_draft]."""
    c = d.config
    eps, theta, hd, nh, kvh = c.rms_norm_eps, c.rope_parameters["rope_theta"], c.head_dim, c.num_attention_heads, \
        c.num_key_value_heads
    ctx = _rms(context @ d.fc.weight.T, d.hidden_norm.weight, eps)
    h = d.embed_tokens.weight[block]
    N, S = block.numel(), context.shape[0]
    for layer in d.layers:
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, eps)
        q = _rope(_rms((x @ a.q_proj.weight.T).view(N, nh, hd), a.q_norm.weight, eps), block_pos, theta, hd)
        kb = _rope(_rms((x @ a.k_proj.weight.T).view(N, kvh, hd), a.k_norm.weight, eps), block_pos, theta, hd)
        kc = _rope(_rms((ctx @ a.k_proj.weight.T).view(S, kvh, hd), a.k_norm.weight, eps), context_pos, theta, hd)
        vb, vc = (x @ a.v_proj.weight.T).view(N, kvh, hd), (ctx @ a.v_proj.weight.T).view(S, kvh, hd)
        k, v = torch.cat([kc, kb]), torch.cat([vc, vb])
        out = torch.empty(N, nh, hd)
        kpos = torch.cat([context_pos, block_pos])
        for i in range(N):
            keys = torch.arange(S + N) < S + (i + 1 if causal else N)
            if window is not None:
                keys &= (block_pos[i] - kpos) < window
            for head in range(nh):
                g = head // (nh // kvh)
                w = torch.softmax(k[keys, g] @ q[i, head] / math.sqrt(hd), 0)
                out[i, head] = w @ v[keys, g]
        h = h + out.reshape(N, nh * hd) @ a.o_proj.weight.T
        m = layer.mlp
        y = _rms(h, layer.post_attention_layernorm.weight, eps)
        h = h + (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(h, d.norm.weight, eps) @ d.lm_head.weight.T


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 5), (True, 2)])
def test_training_forward_equals_per_block_reference(target_model, causal, window):
    """Every block of the batched, masked training forward over a packed row of 3 documents gives
    the logits of the reference run on that block alone (its document's context ≤ anchor, within
    the sliding window), 1e-5."""
    K = 3
    _, d = make_dflash(target_model, K=K, causal=causal, window=window)
    row = random_row(target_model, seed=2)
    blocks = dflash_blocks(row.valid, row.doc_ids, K, 12, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = dflash_forward(d, row, blocks, K)
    assert logits.shape == (12, K, 64)
    if window is not None:  # the window hides context that the full mask shows
        windowed = dflash_mask(blocks.anchors, row.doc_ids, K, causal, window, row.pos_ids)
        assert int(windowed.sum()) < int(dflash_mask(blocks.anchors, row.doc_ids, K, causal).sum())
    seen_docs = set()
    for b, a in enumerate(blocks.anchors.tolist()):
        doc = row.doc_ids == row.doc_ids[a]
        ctx = doc & (torch.arange(row.tokens.numel()) <= a)
        tokens = torch.tensor([int(row.tokens[a])] + [127] * K)
        pos = int(row.pos_ids[a]) + 1 + torch.arange(K + 1)
        with torch.no_grad():
            ref = reference_block_logits(d, row.features[ctx], row.pos_ids[ctx], tokens, pos, causal, window)
        torch.testing.assert_close(logits[b], ref[1:], rtol=1e-5, atol=1e-5)
        seen_docs.add(int(row.doc_ids[a]))
    assert len(seen_docs) >= 2   # blocks of more than one document were checked


def test_gradients_equal_the_per_block_reference(target_model):
    """∂(Σ KL over valid slots / count) of the batched step equals that of the per-block reference,
    parameter by parameter (fp32, 1e-5 relative to the largest entry)."""
    K = 2
    _, d = make_dflash(target_model, K=K, layers=1)
    row = random_row(target_model, seed=6, lengths=(14, 12))
    blocks = dflash_blocks(row.valid, row.doc_ids, K, 6, torch.Generator().manual_seed(1))
    count = float(blocks.valid.sum())
    d.zero_grad()
    loss, counts = dflash_loss(d, row, blocks, "kl", K, count)
    loss.backward()
    got = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    d.zero_grad()
    ref_loss = 0.0
    for b, a in enumerate(blocks.anchors.tolist()):
        doc = row.doc_ids == row.doc_ids[a]
        ctx = doc & (torch.arange(row.tokens.numel()) <= a)
        tokens = torch.tensor([int(row.tokens[a])] + [127] * K)
        pos = int(row.pos_ids[a]) + 1 + torch.arange(K + 1)
        lg = reference_block_logits(d, row.features[ctx], row.pos_ids[ctx], tokens, pos)[1:]
        ref_loss = ref_loss + LOSSES["kl"](lg, row.target_logits[blocks.labels[b]], blocks.valid[b]) / count
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert set(got) == {k for k, p in d.named_parameters() if p.grad is not None}
    for k, p in d.named_parameters():
        if p.grad is None:
            continue
        scale = max(float(p.grad.abs().max()), 1e-8)
        assert float((got[k] - p.grad).abs().max()) <= 1e-5 * scale + 1e-9, k
    assert int(counts[0].sum()) == int(blocks.valid.sum())


# ---- training equals decoding ---------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 4])
def test_propose_equals_training_forward(target_model, window):
    """The decoder's `propose` over pairs 0..a (cached in two chunks through a SlotCache, and in one
    call without a cache) drafts from the logits the training forward gives the block at anchor a,
    with full attention and with a sliding window shorter than the context."""
    K = 3
    t, d = make_dflash(target_model, K=K, window=window)
    ids = torch.randint(0, 128, (1, 22), generator=torch.Generator().manual_seed(5))
    out = t(ids)
    n = 21
    row = PackedRow(ids[0, 1:], out.aux[0, :-1], out.logits[0, 1:], torch.ones(n, dtype=torch.bool),
                    torch.zeros(n, dtype=torch.long), torch.arange(n))
    a = 12
    blocks = dflash_blocks(row.valid, row.doc_ids, K, None)
    with torch.no_grad():
        train = dflash_forward(d, row, blocks, K)[a]
    tri = lambda m, s: torch.cat([torch.ones(m, s, dtype=torch.bool), torch.ones(m, m, dtype=torch.bool).tril()], 1)
    with torch.no_grad():
        one = d.propose(row.tokens[None, : a + 1], row.features[None, : a + 1], torch.arange(a + 1)[None],
                        tri(a + 1, 0)[None], None, K)
        cache = SlotCache()
        first = d.propose(row.tokens[None, :5], row.features[None, :5], torch.arange(5)[None], tri(5, 0)[None], cache, K)
        two = d.propose(row.tokens[None, 5: a + 1], row.features[None, 5: a + 1], torch.arange(5, a + 1)[None],
                        tri(a + 1 - 5, 5)[None], cache, K)
    for prop in (one, two):
        torch.testing.assert_close(prop.logits[0], train, rtol=1e-5, atol=1e-5)
        assert prop.tokens[0].tolist() == d.draft_to_target(train.argmax(-1)).tolist()
        assert prop.forwards == 1
    assert cache.get_seq_length() == a + 1        # the context only: the block's entries are not kept
    assert first.tokens.shape == (1, K)


@pytest.mark.parametrize("window", [None, 3])
def test_engine_decoding_is_lossless_batched(target_model, window):
    """Greedy decoding with a DFlash head through the one decoding engine gives the target's own
    tokens, batch of 3 prompts of different lengths, one draft forward per step; with a sliding
    window, each row drafts in the batch (padding, holes, compaction) what it drafts alone."""
    t, d = make_dflash(target_model, K=4, window=window)
    prompts = [[7, 1, 88, 42, 3, 3], [5, 9], [100, 2, 17, 17, 64, 1, 3, 8, 8]]
    res = generate(t, d, prompts, 4, 30, set())
    for p, r in zip(prompts, res):
        assert r.tokens == target_generate(t, p, 30, set()).tokens
        assert r.draft_forwards == len(r.accepted)
        if window is not None:
            assert r.accepted == generate(t, d, [p], 4, 30, set())[0].accepted


def test_dflash_learns_and_validation_equals_the_step(target_model):
    """A few steps of the objective on one row lower its loss by 3×; validation (no backward)
    reports the training step's counts for the same blocks and leaves the weights untouched."""
    from types import SimpleNamespace

    K = 3
    _, d = make_dflash(target_model, K=K, layers=1)
    d.train()
    row = random_row(target_model, seed=4)
    obj = DFlashObjective(SimpleNamespace(max_anchors=None, loss="kl"), K)

    class One:
        device = torch.device("cpu")
        num_processes = 1

        def reduce(self, x, op):
            return x

    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss, counts = obj.step(d, [(row, obj.sample(row, torch.Generator().manual_seed(0)))], accelerator=One(),
                                amp=torch.autocast("cpu", enabled=False))
        opt.step()
        losses.append(loss)
    assert losses[-1] < losses[0] / 3
    assert counts[0, K - 1] > 0        # the last slot was trained
    d.eval()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    vloss, vcount, vcounts = obj.validate_row(d, row, torch.Generator().manual_seed(0))
    blocks = obj.sample(row, torch.Generator().manual_seed(0))
    ref, ref_counts = dflash_loss(d, row, blocks, "kl", K, 1.0)
    assert abs(vloss - ref.item()) < 1e-4 * max(1.0, abs(ref.item()))
    assert vcount == float(blocks.valid.sum())
    torch.testing.assert_close(vcounts, ref_counts)
    assert all(torch.equal(v, before[k]) for k, v in d.state_dict().items())


def test_a_row_without_blocks_still_runs_one_forward_and_backward(target_model):
    """A row with no loss-valid position has no block to train; the step still runs one forward and
    one backward through a block of invalid slots (loss exactly 0, every gradient it reaches exactly
    0), so the collectives of DDP, DeepSpeed and FSDP see the same calls on every process;
    validation runs its forward too and reports nothing."""
    import dataclasses
    from types import SimpleNamespace

    K = 3
    _, d = make_dflash(target_model, K=K, layers=1)
    row = random_row(target_model, seed=4)
    row = dataclasses.replace(row, valid=torch.zeros_like(row.valid))
    obj = DFlashObjective(SimpleNamespace(max_anchors=None, loss="kl"), K)
    assert obj.sample(row, torch.Generator().manual_seed(0)).anchors.numel() == 0

    class One:
        device = torch.device("cpu")
        num_processes = 1

        def reduce(self, x, op):
            return x

    calls = []
    d.zero_grad()
    loss, counts = obj.step(d, [(row, obj.sample(row, torch.Generator().manual_seed(0)))], accelerator=One(),
                            amp=torch.autocast("cpu", enabled=False), backward=lambda x: (calls.append(1), x.backward()))
    assert calls == [1] and loss == 0.0 and not counts.any()
    assert obj.backward_passes([(row, None)] * 3) == 3  # announced to a sharded engine (one per row)
    grads = [p.grad for p in d.parameters() if p.grad is not None]
    assert grads and all(not g.any() for g in grads)
    forwards = []
    hook = d.register_forward_hook(lambda *a: forwards.append(1))
    vloss, vcount, vcounts = obj.validate_row(d, row, torch.Generator().manual_seed(0))
    hook.remove()
    assert forwards == [1] and (vloss, vcount) == (0.0, 0.0) and not vcounts.any()


# ---- export ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_export_is_what_vllm_dflash_reads(tmp_path, target_model, causal):
    """config.json holds the keys vLLM's `update_dflash` reads (0.22–0.34 wheels), the tensors carry
    the names its DFlash loader maps (fc, hidden_norm, q_norm/k_norm, no mask_hidden), and the
    export reads back as the same head: the same proposals from a checkpoint-equal bf16 reload."""
    from safetensors.torch import load_file

    from peagle_train.draft.head_files import load_checkpoint, save_checkpoint
    from peagle_train.export.speculators import validate_export, write_export
    from peagle_train.draft.head_files import load_export

    t, d = make_dflash(target_model, K=4, causal=causal)
    ckpt, _ = load_checkpoint(save_checkpoint(d, tmp_path / "ckpt"))
    assert isinstance(ckpt, DFlashDraft) and ckpt.config.block_causal is causal
    out = write_export(ckpt, tmp_path / "exp", verifier_name_or_path="org/target", verifier_architectures=["L"],
                       card={"acceptance": {}})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 5] and "eagle_aux_hidden_state_layer_ids" not in cfg
    assert cfg["mask_token_id"] == 127 and cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 64
    assert cfg["block_size"] == 5 and cfg["sliding_window_non_causal"] is (not causal)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    sd = load_file(str(out / "model.safetensors"))
    assert "mask_hidden" not in sd and sd["fc.weight"].shape == (64, 192) and sd["hidden_norm.weight"].shape == (64,)
    assert sd["layers.1.self_attn.q_norm.weight"].shape == (16,) and sd["layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    validate_export(out, reference=ckpt)
    card = (out / "README.md").read_text()
    assert "# DFlash draft head for org/target" in card
    assert ('vllm serve org/target --speculative-config \'{"method": "dflash", "model": "<this directory>", '
            '"num_speculative_tokens": 4}\'') in card
    assert ("pip install 'vllm>=0.28'" if causal else "pip install 'vllm>=0.22'") in card
    back = load_export(out)
    assert isinstance(back, DFlashDraft) and back.config.block_causal is causal
    for prompt in ([1, 2, 3, 4, 5], [90, 80, 70]):
        a, b = generate(t, ckpt, [prompt], 4, 24, set())[0], generate(t, back, [prompt], 4, 24, set())[0]
        assert a.tokens == b.tokens == target_generate(t, prompt, 24, set()).tokens
        assert a.accepted == b.accepted


def test_validator_names_a_broken_dflash_export(tmp_path, target_model):
    from safetensors.torch import load_file, save_file

    from peagle_train.export.speculators import ExportError, validate_export, write_export

    _, d = make_dflash(target_model, K=3, layers=1)
    out = write_export(d, tmp_path / "exp", verifier_name_or_path="x", verifier_architectures=["L"])
    sd = load_file(str(out / "model.safetensors"))
    del sd["hidden_norm.weight"]
    sd["mask_hidden"] = torch.zeros(1, 1, 192)
    save_file(sd, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [5, 2, 4]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError) as e:
        validate_export(out)
    msg = str(e.value)
    assert "missing tensor hidden_norm.weight" in msg and "unexpected tensor mask_hidden" in msg
    assert "aux_hidden_state_layer_ids [5, 2, 4] are not ascending" in msg


def test_a_dflash_head_reads_any_number_of_aux_layers(tmp_path, target_model):
    """5 aux layers: the target gives 5H-wide features, the head's fc reads them, training equals
    propose, the export names the 5 ids and validates; P-EAGLE and EAGLE-3 still take exactly 3."""
    from peagle_train.config import config_problems, default_config
    from peagle_train.export.speculators import validate_export, write_export
    from peagle_train.errors import ConfigError

    ids5 = [1, 2, 3, 4, 6]
    t = FeatureTarget(target_model, ids5, aux_count=None)
    with pytest.raises(ConfigError, match=r"target.aux_layer_ids=\[1, 2, 3, 4, 6\] must be 3 distinct layer ids in \[0, 8\)"):
        FeatureTarget(target_model, ids5)
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=64, mask_token_id=127,
                                  num_depths=3, aux_layer_ids=ids5, algorithm="dflash")
    with pytest.raises(ValueError, match=r"a peagle head reads 3 aux layers"):
        DraftConfig.from_target(target_model.config, num_layers=1, draft_vocab_size=64, mask_token_id=127,
                                num_depths=3, aux_layer_ids=ids5, algorithm="peagle")
    d = make_draft_head(cfg).eval()
    ids = torch.arange(0, 128, 2)
    d.init_from_target(target_model, ids, ids - torch.arange(64), torch.zeros(128, dtype=torch.bool).index_fill_(0, ids, True))
    x = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    out = t(x)
    assert out.aux.shape == (1, 16, 5 * 64) and d.fc.weight.shape == (64, 5 * 64)
    n = 15
    row = PackedRow(x[0, 1:], out.aux[0, :-1], out.logits[0, 1:], torch.ones(n, dtype=torch.bool),
                    torch.zeros(n, dtype=torch.long), torch.arange(n))
    blocks = dflash_blocks(row.valid, row.doc_ids, 3, None)
    with torch.no_grad():
        train = dflash_forward(d, row, blocks, 3)[9]
        prop = d.propose(row.tokens[None, :10], row.features[None, :10], torch.arange(10)[None],
                         torch.ones(10, 10, dtype=torch.bool).tril()[None], None, 3)
    torch.testing.assert_close(prop.logits[0], train, rtol=1e-5, atol=1e-5)
    res = generate(t, d, [[7, 1, 88, 42]], 3, 20, set())[0]
    assert res.tokens == target_generate(t, [7, 1, 88, 42], 20, set()).tokens
    exp = write_export(d, tmp_path / "exp", verifier_name_or_path="x", verifier_architectures=["L"])
    assert json.loads((exp / "config.json").read_text())["aux_hidden_state_layer_ids"] == ids5
    validate_export(exp, reference=d)
    # the settings validator admits 5 ids for dflash only
    base = default_config()
    base.target.aux_layer_ids = ids5
    assert any("must be 3 distinct layer ids" in p for p in config_problems(base, "train"))
    base.algorithm = "dflash"
    assert not any("aux_layer_ids" in p for p in config_problems(base, "train"))
