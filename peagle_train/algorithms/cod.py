"""COD (conditional drop-token) sampling and the P-EAGLE attention mask (DESIGN.md §4;
P-EAGLE arXiv 2602.01469 §3.2).

All depths of a packed row live on one axis: [depth 0 | depth 1 | ... ]. An element is a pair
(anchor a, depth d): depth 0 is every row position (real token and feature), a depth-d element
predicts the token d steps past its anchor's own prediction, from the mask token and `mask_hidden`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import Attention
from ..errors import UserError


@dataclass
class CODElements:
    """Elements of one packed row. anchors, depths: [M] int64 (depth 0 first, then 1, 2, ...)."""

    anchors: torch.Tensor
    depths: torch.Tensor

    @property
    def targets(self) -> torch.Tensor:
        """Row position whose target distribution each element learns: anchor + depth. [M]"""
        return self.anchors + self.depths


def cod_sample(
    valid: torch.Tensor,
    doc_ids: torch.Tensor,
    num_depths: int,
    down_sample_ratio: float = 0.7,
    down_sample_ratio_min: float = 0.2,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
) -> CODElements:
    """Sample the COD elements of one packed row.

    valid: [n] bool, loss-valid row positions V (after the EAGLE shift); doc_ids: [n] int64.
    Depth 0 = every position. S = V restricted to positions whose anchor c-1 lies in the same
    document (or a random `max_anchors`-subset), P_1 = S; for d = 1..K-1,
    m_d = floor((|S| - d) * max(r^d, r_min)) (stop when ≤ 0), C_d = random m_d-subset of P_d (all
    of P_d if smaller); c ∈ C_d is element (c - d, d); P_{d+1} = {c+1 : c ∈ C_d, c+1 ∈ V, same doc}.
    Deterministic for a given `generator` state.
    """
    n = valid.numel()
    valid = valid.bool()
    anchors = [torch.arange(n)]
    depths = [torch.zeros(n, dtype=torch.long)]
    # a valid position c can start a chain only if its anchor c-1 exists in the same document
    has_anchor = torch.zeros(n, dtype=torch.bool)
    has_anchor[1:] = doc_ids[1:] == doc_ids[:-1]
    S = (valid & has_anchor).nonzero().flatten()
    if max_anchors is not None and S.numel() > max_anchors:
        S = S[torch.randperm(S.numel(), generator=generator)[:max_anchors]].sort().values
    P = S
    for d in range(1, num_depths):
        m = math.floor((S.numel() - d) * max(down_sample_ratio**d, down_sample_ratio_min))
        if m <= 0 or P.numel() == 0:
            break
        C = P if P.numel() <= m else P[torch.randperm(P.numel(), generator=generator)[:m]].sort().values
        anchors.append(C - d)
        depths.append(torch.full((C.numel(),), d, dtype=torch.long))
        nxt = C + 1
        keep = nxt < n
        nxt, C = nxt[keep], C[keep]
        P = nxt[valid[nxt] & (doc_ids[nxt] == doc_ids[C])]
    return CODElements(torch.cat(anchors), torch.cat(depths))


def _cod_rule(aq, dq, docq, ak, dk, dock):
    """The §4 visibility rule on broadcastable tensors (shared by the dense and the flex mask)."""
    return (docq == dock) & (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq)))


def cod_attention_mask(anchors: torch.Tensor, depths: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """The P-EAGLE training mask, dense (the exact fallback used on CPU).

    anchors, depths: [M]; doc_ids: [n] (per row position).
    Query (a_q, d_q) sees key (a_k, d_k) iff same document and either d_k = 0 and a_k ≤ a_q
    (the context up to its anchor) or a_k = a_q and d_k ≤ d_q (its own chain). Depth-0 queries
    thus get causal attention within their document. Returns [M, M] bool (True = may attend).
    """
    docs = doc_ids[anchors]
    return _cod_rule(anchors[:, None], depths[:, None], docs[:, None], anchors[None, :], depths[None, :], docs[None, :])


FLEX_MASK_BYTES_PER_PAIR = 10.0     # eager create_block_mask on [Mq, M]: bytes per (query, key) pair at its peak
                                    # (CPU, measured by benchmarks/calibrate_plan.py; training/memory.py's model)
BLOCK_MASK_COMPILED_ON = ("cuda",)  # device types whose block mask is built compiled (the rest: eagerly)
BLOCK_MASK_BACKEND = "inductor"     # the torch.compile backend of that build
BLOCK_MASK_BUILDS = {"builders": 0, "compiles": 0, "builds": 0}  # this process's counts (`block_mask_build_counts`)
_block_mask_builder = None


class BlockMaskBuildError(UserError, RuntimeError):
    """The compiled block-mask build could not run, and an eager build (the whole [Mq, M] mask at
    once) is refused in its place."""


def _build_cod_block_mask(anchors: torch.Tensor, depths: torch.Tensor, docs: torch.Tensor, q_start: int):
    """create_block_mask over the §4 rule; anchors, depths, docs (each element's document): [M].
    The one body of both builds: called as is (eager) or through `compiled_block_mask_builder`."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        qi = q + q_start
        return _cod_rule(anchors[qi], depths[qi], docs[qi], anchors[k], depths[k], docs[k])

    M = anchors.shape[0]
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=M - q_start, KV_LEN=M, device=anchors.device)


def _counting_backend(gm, example_inputs):
    """`BLOCK_MASK_BACKEND`, counting each (re)compile of the block-mask build."""
    BLOCK_MASK_BUILDS["compiles"] += 1
    return torch._dynamo.lookup_backend(BLOCK_MASK_BACKEND)(gm, example_inputs)


def compiled_block_mask_builder():
    """The process's compiled block-mask build, made on first use and reused: `torch.compile` of
    `_build_cod_block_mask` (torch's recommended replacement for `create_block_mask(_compile=True)`,
    which wraps a new torch.compile per call), with dynamic shapes so that a new row length or
    q_start does not recompile, and fullgraph so that a graph break, a compile failure or Dynamo's
    recompile limit raises instead of running the build eagerly."""
    global _block_mask_builder
    if _block_mask_builder is None:
        _block_mask_builder = torch.compile(_build_cod_block_mask, backend=_counting_backend, dynamic=True,
                                            fullgraph=True)
        BLOCK_MASK_BUILDS["builders"] += 1
    return _block_mask_builder


def block_mask_build_counts() -> dict:
    """This process's compiled block-mask builds: builders made (1 once used), compiles (the first
    plus each recompile), recompiles, builds (calls)."""
    return {**BLOCK_MASK_BUILDS, "recompiles": max(0, BLOCK_MASK_BUILDS["compiles"] - 1)}


def _eager_fallback_cause(anchors: torch.Tensor, q_start: int, cause: str, fix: str) -> BlockMaskBuildError:
    M = anchors.numel()
    pairs = (M - q_start) * M
    return BlockMaskBuildError(
        f"COD block mask on {anchors.device} ({M - q_start} queries × {M} keys): {cause}; an eager build "
        f"would hold the whole mask (≈ {FLEX_MASK_BYTES_PER_PAIR * pairs / 1e9:.3g} GB) and is refused: {fix}")


def _dynamo_off() -> str | None:
    """The setting that makes torch.compile run functions eagerly, if one is set."""
    if torch._dynamo.config.disable:
        return "torch._dynamo.config.disable (TORCHDYNAMO_DISABLE=1)"
    stance = getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default")
    if stance not in ("default", "fail_on_recompile"):
        return f"torch.compiler.set_stance({stance!r})"
    return None


def cod_block_mask(anchors: torch.Tensor, depths: torch.Tensor, doc_ids: torch.Tensor, q_start: int = 0):
    """The same mask as a FlexAttention BlockMask ([1, 1, M - q_start, M]: queries are the
    elements from q_start on, keys all elements); fully masked 128×128 blocks are skipped by the
    kernel, so cost and memory follow the number of visible blocks, not M².

    On the devices of `BLOCK_MASK_COMPILED_ON` (CUDA) the build is compiled (block by block, no
    [Mq, M] tensor), by the process's one `compiled_block_mask_builder`; elsewhere (CPU, where
    FlexAttention has no backward: tests) it runs eagerly and materialises the [Mq, M] mask first
    (≈ 10 bytes a pair transient: 21 GB at 16k-token rows with all anchors).
    Raises BlockMaskBuildError when the compiled build cannot run (compile failure, Dynamo's
    recompile limit, torch.compile switched off) instead of building eagerly."""
    docs = doc_ids[anchors]
    if anchors.device.type not in BLOCK_MASK_COMPILED_ON:
        return _build_cod_block_mask(anchors, depths, docs, q_start)
    import torch._dynamo

    off = _dynamo_off()
    if off:
        raise _eager_fallback_cause(anchors, q_start, f"{off} runs torch.compile eagerly",
                                    "unset it, or use training.attention=sparse (no M×M build)")
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    build = compiled_block_mask_builder()
    BLOCK_MASK_BUILDS["builds"] += 1
    try:
        mask = build(anchors, depths, docs, q_start)
    except FailOnRecompileLimitHit as e:
        raise _eager_fallback_cause(
            anchors, q_start, f"its build was recompiled past torch._dynamo.config.recompile_limit="
            f"{torch._dynamo.config.recompile_limit} after {BLOCK_MASK_BUILDS['compiles']} compiles (row lengths "
            "do not recompile it; a new dtype or device of anchors/depths/doc_ids does: TORCH_LOGS=recompiles "
            "names the guard)", "keep those fixed, raise that limit, or use training.attention=sparse "
            "(no M×M build)") from e
    except TorchDynamoException as e:
        inner = getattr(e, "inner_exception", e)  # the backend's own error, under BackendCompilerFailed
        first = (str(inner).strip().splitlines() or [""])[0]
        raise _eager_fallback_cause(
            anchors, q_start, f"torch.compile of its build failed ({type(inner).__name__}: {first})",
            "fix the compiler toolchain (TORCH_LOGS=dynamo,inductor), or use training.attention=sparse "
            "(no M×M build)") from e
    if BLOCK_MASK_BUILDS["compiles"] == 0:
        raise _eager_fallback_cause(anchors, q_start, "torch.compile ran its build eagerly (nothing compiled)",
                                    "check torch.compiler's stance, or use training.attention=sparse")
    return mask


def cod_mask(anchors: torch.Tensor, depths: torch.Tensor, doc_ids: torch.Tensor, kind: str | bool = "dense",
             q_start: int = 0):
    """The COD mask for queries = elements[q_start:], keys = all elements, of the given `kind`
    (`attention_kind`): "dense" a [1, Mq, M] bool mask, "flex" a FlexAttention BlockMask,
    "sparse" a `CODSparseMask` (algorithms/cod_attention.py: no M×M tensor, SDPA per document and per
    block of slots). A bool `kind` is read as flex (True) or dense (False)."""
    kind = {True: "flex", False: "dense"}.get(kind, kind) if isinstance(kind, bool) else kind
    if kind == "flex":
        return cod_block_mask(anchors, depths, doc_ids, q_start)
    if kind == "sparse":
        from .cod_attention import cod_sparse_mask

        return cod_sparse_mask(anchors, depths, doc_ids, q_start)
    if kind != "dense":
        raise ValueError(f"COD mask kind {kind!r} must be dense, flex or sparse")
    docs = doc_ids[anchors]
    q = slice(q_start, None)
    return _cod_rule(anchors[q, None], depths[q, None], docs[q, None], anchors[None], depths[None], docs[None])[None]


ATTENTION_SETTINGS = tuple(Attention.values())  # the `training.attention` choices (config.py)


def attention_kind(attention: str, device: torch.device) -> str:
    """The mask kind for `training.attention` on `device`: `flex`, `sparse` and `dense` as named;
    `auto` = flex on CUDA (FlexAttention's fused kernel skips empty blocks), sparse on CPU (SDPA
    per document and per block of slots, algorithms/cod_attention.py), dense elsewhere.

    Raises ValueError for any other setting, and for `flex` on a CPU device (FlexAttention has
    no backward on CPU)."""
    if attention not in ATTENTION_SETTINGS:
        raise ValueError(f"training.attention={attention!r} must be one of {', '.join(ATTENTION_SETTINGS)}")
    kind = torch.device(device).type
    if attention == "flex" and kind == "cpu":
        raise ValueError("training.attention=flex: FlexAttention has no backward on CPU; use auto, sparse or dense here")
    if attention != "auto":
        return attention
    return {"cuda": "flex", "cpu": "sparse"}.get(kind, "dense")
