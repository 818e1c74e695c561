"""Capture of the target's aux hidden states and final hidden state, and the EAGLE alignment.

DESIGN.md §2: aux layers default to [2, N//2, N-3] in vLLM's and speculators' numbering
(target/aux_layers.py `AUX_LAYER_NUMBERING`): id k is the hidden state *entering* decoder layer k, HF
`output_hidden_states[k]`, i.e. the output of layer k-1. The final hidden state is the last decoder
layer's output before the final norm. Forward hooks on the decoder layers capture them without
asking the model for all N hidden states.

Packed rows (several documents, one forward): `FeatureTarget.forward_documents` concatenates the
documents on one axis with position ids restarting at 0 per document, and a registered attention
function (`document_attention`) runs SDPA causally within each document. Every per-token op
(embeddings, norms, projections, MLP) sees the same values as in a per-document forward, and each
document's attention is the very SDPA call of its own forward, so the features equal the
per-document forward's (bit for bit on CPU for documents of ≥ 4 tokens; BLAS takes another path
for 1-3 rows, within 1e-6 of it).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .aux_layers import AuxLayers

DOCUMENT_ATTENTION = "peagle_documents"


def document_attention(module, query, key, value, attention_mask, doc_lengths=None, **kw):
    """Causal attention within each document of a packed row (block-diagonal, no mask built).

    query [B, heads, N, d], key/value [B, kv_heads, N, d]; doc_lengths: document lengths summing to
    N (their order is the row's). Runs transformers' own `sdpa_attention_forward` on each
    document's slice with no mask (its causal path, as a one-document forward does) and returns
    ([B, N, heads, d], None). Without doc_lengths it is plain SDPA (mask passed through)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if doc_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    outs, s = [], 0
    for n in doc_lengths:
        o, _ = sdpa_attention_forward(module, query[:, :, s:s + n], key[:, :, s:s + n], value[:, :, s:s + n], None, **kw)
        outs.append(o)
        s += n
    return torch.cat(outs, dim=1), None


DECODE_ATTENTION = "peagle_decode"


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Attention for the decoding forwards of a half-precision target on CPU (on CUDA they run
    the model's own SDPA: `FeatureTarget.decode_attn_implementation`): scores, softmax and the
    weighted sum in fp32 (inputs upcast), the output rounded once to the input dtype.

    query [B, heads, n, d], key/value [B, kv_heads, S, d] (S ≥ n: the cache, then the n new
    slots; query's dtype, or fp32 from an upcast `SlotCache`, then read without a copy);
    attention_mask: None (causal: new slot i sees the cache and new slots ≤ i; no mask for n = 1),
    a bool [B|1, 1, n, S] (True = attend; transformers' `sdpa` masks, the decoding engine's
    validity masks) or an additive float mask of that shape. Returns ([B, n, heads, d],
    None). The g = heads / kv_heads query heads of a kv head are folded into the query axis, so a
    layer is two batched matmuls over [B, kv_heads, g·n, S] without repeating the cache. PyTorch's
    CPU SDPA kernels are several times slower than this at decoding shapes (few queries over a long
    cache; measured in docs/DESIGN.md §5). fp32 tensors,
    dropout and options this does not implement (softcap, attention sinks, a per-head mask) go to
    transformers' `sdpa_attention_forward` unchanged.

    A plug-in may register its own decoding attention (accel/cpu/attention.py: the AMX kernel over
    a bf16 cache) and name it in the config (`decoding_attention`); this one is the default."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, n, d = query.shape
    kvh, S = key.shape[1], key.shape[2]
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    if (query.dtype == torch.float32 or dropout or per_head_mask or H % kvh
            or kw.get("softcap") is not None or kw.get("s_aux") is not None):
        if key.dtype != query.dtype:  # an upcast cache (draft/kv_cache.py): its entries were query.dtype
            key, value = key.to(query.dtype), value.to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
    g = H // kvh
    scale = scaling if scaling is not None else d ** -0.5
    scores = torch.matmul(query.float().reshape(B, kvh, g * n, d), key.float().transpose(-1, -2)).mul_(scale)
    scores = scores.view(B, kvh, g, n, S)
    if attention_mask is None and n > 1:  # causal over the new slots, all of the cache visible
        attention_mask = torch.ones(n, S, dtype=torch.bool, device=query.device).tril(S - n)[None, None]
    if attention_mask is not None:
        m = attention_mask[:, :, None]  # [B|1, 1, 1, n, S] over the folded groups
        scores = scores.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else scores.add_(m.float())
    probs = scores.view(B, kvh, g * n, S).softmax(-1)
    out = torch.matmul(probs, value.float()).view(B, H, n, d)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def register_attention() -> None:
    """Register `document_attention` (as DOCUMENT_ATTENTION) and `decode_attention` (as
    DECODE_ATTENTION, with the masks `sdpa` gets: causal, sliding window) in transformers' attention
    interface, each name only where nothing is registered under it yet (a function registered
    there first, e.g. a test's spy, is kept). `FeatureTarget` calls it, since its packed and
    decoding forwards name these functions; importing this module registers nothing."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in ((DOCUMENT_ATTENTION, document_attention), (DECODE_ATTENTION, decode_attention)):
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, fn)
    if DECODE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


def decoding_attention(config) -> str:
    """The attention implementation that decoding forwards of a target with this config run: the
    one a plug-in registered in transformers' attention interface and named in
    `config.peagle_decode_attention` (accel/cpu: the AMX kernel), else `DECODE_ATTENTION`."""
    return getattr(config, "peagle_decode_attention", None) or DECODE_ATTENTION


def keeps_cache_dtype(config, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decoding attention of `config` (`decoding_attention`) reads a cache of this
    half-precision dtype and head size itself, so the decoding engine keeps the cache in the
    model's dtype instead of fp32: the registered function says so through its `keeps_cache_dtype`
    attribute (dtype, head_dim) -> bool; `decode_attention` has none."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS.get(decoding_attention(config))
    keeps = getattr(fn, "keeps_cache_dtype", None)
    return bool(keeps is not None and keeps(dtype, head_dim))


@contextmanager
def attention_implementation(config, name: str | None):
    """Run the target's forwards with attention function `name` (`register_attention`) instead of its
    own; None, or a target that does not use `sdpa`, leaves it unchanged."""
    saved = config._attn_implementation
    if name is None or saved != "sdpa":
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = saved


@dataclass
class TargetOutput:
    """logits: [B, T, V] (or [B, T, V_draft] when restricted; None from forward_documents(logits=False));
    aux: [B, T, 3H] the aux hidden states (HF hidden_states[k] for each aux id k) concatenated in id order; final: [B, T, H] the pre-norm
    last-layer output."""

    logits: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor


class FeatureTarget:
    """A frozen HF causal LM with hooks that capture aux and pre-norm final hidden states.

    `forward(input_ids, draft_ids=None, **kw)` runs the decoder once. With `draft_ids` the logits
    are `lm_head(norm(final))` restricted to those rows (the KL targets, [B, T, V_draft]) and the
    full-vocabulary head is never computed; without them, full logits (decoding). Any extra
    `cache` is an HF cache object (DynamicCache) for decoding, whose forwards run the attention of
    `decode_attn_implementation`; any other keyword (attention_mask, position_ids) is passed to
    the HF model.
    """

    sdpa_decoding: bool | None = None  # `decode_attn_implementation`: None by device, True / False force a path

    def __init__(self, model, aux_layer_ids: list[int] | None = None, aux_count: int | None = 3):
        register_attention()  # the functions that forward_documents and the decoding forwards name
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        n = len(self.layers)
        self.aux_layer_ids = AuxLayers.resolve(aux_layer_ids, n, count=aux_count).to_json()
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers ≥ 5.2x renamed it
        self._captured: dict[int, torch.Tensor] = {}
        # aux id k (the input of layer k) is the output of layer k-1, captured by a hook on that layer;
        # id 0 is the embeddings' output (captured under -1)
        self._capture_ids = tuple(sorted({k - 1 for k in self.aux_layer_ids} | {n - 1}))
        for i in self._capture_ids:
            (self.decoder.embed_tokens if i < 0 else self.layers[i]).register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(_module, _inp, out):
            self._captured[i] = out[0] if isinstance(out, tuple) else out
        return fn

    @property
    def config(self):
        return self.model.config

    @property
    def decode_attn_implementation(self) -> str | None:
        """The attention implementation that this target's decoding forwards (those with a cache)
        switch to, or None for the model's own. None: an fp32 target, or a half-precision one on
        CUDA (`sdpa_decoding` None) or with `sdpa_decoding` True: transformers' SDPA in the model's
        dtype over a cache in that dtype. Otherwise (on CPU by default) `decoding_attention(config)`:
        `decode_attention` in fp32 (or a plug-in's), whose cache decoding/engine.py `target_cache`
        keeps in fp32. A target whose own implementation is not `sdpa` keeps it either way
        (`attention_implementation`)."""
        if self.model.dtype == torch.float32:
            return None
        sdpa = self.sdpa_decoding if self.sdpa_decoding is not None else self.model.device.type == "cuda"
        return None if sdpa else decoding_attention(self.decoder.config)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, draft_ids: torch.Tensor | None = None, cache=None,
                last_only: bool = False, float_logits: bool = True, **kw) -> TargetOutput:
        """last_only: logits of the last position only ([B, 1, V]; a decoding prefill needs no more).
        float_logits False: logits in the model's dtype, not converted to fp32 (decoding: an argmax
        needs no copy, and sampling converts the rows it uses)."""
        self._captured.clear()
        # decoding (a cache) in half precision: on CPU attention in fp32 (`decode_attention`, or a
        # plug-in's); on CUDA the model's own SDPA (`decode_attn_implementation`)
        if cache is not None:
            kw[self._cache_kw] = cache
        with attention_implementation(self.decoder.config, self.decode_attn_implementation if cache is not None else None):
            normed = self.decoder(input_ids=input_ids, use_cache=cache is not None, **kw).last_hidden_state
        aux = torch.cat([self._captured[k - 1] for k in self.aux_layer_ids], dim=-1)
        final = self._captured[len(self.layers) - 1]
        hidden = normed[:, -1:] if last_only else normed
        return TargetOutput(self._head(hidden, draft_ids, float_logits), aux, final)

    __call__ = forward

    @property
    def packs_documents(self) -> bool:
        """Whether `forward_documents` runs a packed row in one forward: SDPA attention and every
        layer full causal attention (sliding-window layers, e.g. Gemma-3, GPT-OSS, need their own
        masks: those targets run one document per forward)."""
        cfg = self.decoder.config
        types = getattr(cfg, "layer_types", None)
        full = all(t == "full_attention" for t in types) if types else getattr(cfg, "sliding_window", None) is None
        return cfg._attn_implementation == "sdpa" and full

    @torch.no_grad()
    def forward_documents(self, docs: list[torch.Tensor], draft_ids: torch.Tensor | None = None,
                          logits: bool = True) -> list[TargetOutput]:
        """All documents of a packed row through the target in one forward (block-diagonal
        attention, position ids restarting per document); one forward per document where the
        target cannot pack (`packs_documents`).

        docs: token ids [T_i] each (on the target's device). Returns one TargetOutput per document
        ([1, T_i, ...] each), equal to `self(doc[None], draft_ids)`. logits=False: features only
        (`logits` is None; the head runs on one position, e.g. for offline feature shards)."""
        if len(docs) == 1 or not self.packs_documents:
            outs = [self(ids[None], draft_ids=draft_ids, last_only=not logits) for ids in docs]
            return outs if logits else [TargetOutput(None, o.aux, o.final) for o in outs]
        lengths = [int(ids.numel()) for ids in docs]
        dev = docs[0].device
        pos = torch.cat([torch.arange(n, device=dev) for n in lengths])[None]
        with attention_implementation(self.decoder.config, DOCUMENT_ATTENTION):  # no mask is built for it
            out = self(torch.cat(docs)[None], draft_ids=draft_ids, position_ids=pos, doc_lengths=lengths,
                       last_only=not logits)
        aux, final = out.aux.split(lengths, dim=1), out.final.split(lengths, dim=1)
        tl = out.logits.split(lengths, dim=1) if logits else [None] * len(docs)
        return [TargetOutput(*p) for p in zip(tl, aux, final)]

    @torch.no_grad()
    def logits_from_final(self, final: torch.Tensor, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits from stored pre-norm final hidden states: `lm_head(norm(final))`
        (with Gemma's final soft-capping), restricted to `draft_ids` if given (DESIGN.md §2).

        final: [..., H] (any float dtype; cast to the target's). Returns fp32 [..., V] or
        [..., V_draft], equal to what `forward` gives for the same states (offline features)."""
        w = self.model.get_output_embeddings().weight
        return self._head(self.decoder.norm(final.to(w.dtype)), draft_ids)

    def _draft_rows(self, weight: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
        """weight[draft_ids]: the lm_head rows of the draft vocabulary, gathered once for the same
        weight and draft-ids tensors (the same objects on the same storage, unchanged since: their
        version counters) instead of at every call (a full vocabulary's rows are 100+ MB)."""
        state = (weight._version, weight.data_ptr(), draft_ids._version, draft_ids.data_ptr())
        cached = getattr(self, "_draft_rows_cache", None)
        if cached is None or cached[0] is not weight or cached[1] is not draft_ids or cached[2] != state:
            cached = (weight, draft_ids, state, weight.detach()[draft_ids])
            self._draft_rows_cache = cached
        return cached[3]

    def _head(self, normed: torch.Tensor, draft_ids: torch.Tensor | None, float_logits: bool = True) -> torch.Tensor:
        module = self.model.get_output_embeddings()  # an nn.Linear, or a plug-in's swap of it (accel/cpu)
        logits = module(normed) if draft_ids is None else normed @ self._draft_rows(module.weight, draft_ids).T
        softcap = getattr(self.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.float() if float_logits else logits


def align_for_draft(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, target_logits: torch.Tensor):
    """The EAGLE pairing (DESIGN.md §2): for tokens x_0..x_{T-1}, row position i holds token
    x_{i+1}, aux feature g_i, the target distribution from position i+1 and loss mask l_{i+1}.

    Shapes in: input_ids, loss_mask [T]; aux [T, 3H]; target_logits [T, V_draft].
    Shapes out (each one shorter): tokens [T-1], features [T-1, 3H], target_logits [T-1, V_draft],
    loss_mask [T-1]. Position i therefore trains the draft to predict x_{i+2}.
    """
    return input_ids[1:], aux[:-1], target_logits[1:], loss_mask[1:]
