"""A head's token embeddings: the target's rows, all trainable or frozen but the mask token's.

`draft.train_embeddings` (DraftConfig.train_embeddings) chooses the module `embed_tokens` is:
    all       nn.Embedding [V, H], every row trainable (speculators' `embed_requires_grad` for P-EAGLE)
    mask_row  `MaskRowEmbedding`: the target's rows frozen (no gradient, no optimizer state) and one
              trainable row for the mask token, the only one the target never trained. At 8B
              (128k × 4096) it saves ~8 GB of fp32 gradient and AdamW moments.

Both write one `embed_tokens.weight` [V, H] into a state dict (the mask row merged in), so
checkpoints and exports (vLLM loads `embed_tokens.weight`) have one format, and a state dict of
either form loads into a head of either form. A sharded state dict (FSDP2 DTensors, ZeRO-3
partitions) keeps the two tensors `embed_tokens.weight` and `embed_tokens.mask_row` apart (merging
would gather them inside a hook); every head folds that form back when it loads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..options import TrainEmbeddings

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without distributed: no sharded tensors
    DTensor = ()

MASK_ROW = "mask_row"  # the state-dict name of the separate row: embed_tokens.mask_row


def _whole(t) -> bool:
    """A plain tensor holding all of its values (not a DTensor shard, not a ZeRO-3 partition)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.numel() > 0


def fold_mask_row(state_dict: dict, prefix: str, mask_token_id: int) -> None:
    """Merge a separate `<prefix>mask_row` [H] into `<prefix>weight` [V, H] of `state_dict`, in
    place (the weight is copied, never written through): the form a sharded engine saves, read
    into an `all` head. A no-op when there is no separate row or either tensor is not whole."""
    w, row = state_dict.get(prefix + "weight"), state_dict.get(prefix + MASK_ROW)
    if row is None or not (_whole(w) and _whole(row)):
        return
    merged = w.detach().clone()
    merged[mask_token_id] = row.detach().to(merged.dtype).reshape(-1)
    state_dict[prefix + "weight"] = merged
    del state_dict[prefix + MASK_ROW]


class MaskRowEmbedding(nn.Module):
    """Token embeddings with every row frozen but the mask token's (`draft.train_embeddings=mask_row`).

    weight [V, H]: the target's embeddings, a Parameter with requires_grad False (no .grad, and
    the trainer's optimizer, built over the trainable parameters, holds no state for it); its row
    `mask_token_id` is not read. mask_row [H]: the mask token's embedding, trainable.
    forward(tokens [..] int64) → [.., H]: `weight[tokens]`, with `mask_row` where the token is the
    mask token (`torch.where`: the same values, bit for bit, as nn.Embedding over the merged weight).
    Its state dict holds one merged `weight` (see the module docstring); loading a state dict
    without `mask_row` (`load_state_dict({"weight": target_embeddings})` included) gives it the
    weight's mask token row.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mask_token_id: int):
        super().__init__()
        self.mask_token_id = mask_token_id
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim).normal_(), requires_grad=False)
        self.mask_row = nn.Parameter(self.weight[mask_token_id].clone())
        self.register_state_dict_post_hook(MaskRowEmbedding._merge_on_save)
        self.register_load_state_dict_pre_hook(MaskRowEmbedding._split_on_load)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embeds = F.embedding(tokens, self.weight)
        return torch.where((tokens == self.mask_token_id)[..., None], self.mask_row.to(embeds.dtype), embeds)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, trainable row {self.mask_token_id}"

    @staticmethod
    def _merge_on_save(module, state_dict, prefix, local_metadata):
        fold_mask_row(state_dict, prefix, module.mask_token_id)

    @staticmethod
    def _split_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        w = state_dict.get(prefix + "weight")
        if prefix + MASK_ROW not in state_dict and _whole(w) and w.dim() == 2 and w.shape[0] > module.mask_token_id:
            state_dict[prefix + MASK_ROW] = w[module.mask_token_id]


def _fold_on_load(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    fold_mask_row(state_dict, prefix, module.mask_token_id)


def token_embedding(num_embeddings: int, embedding_dim: int, mask_token_id: int, train: str) -> nn.Module:
    """`embed_tokens` of a head: nn.Embedding (`train` = "all"; "none": frozen, the target's own
    embedding with no gradient or optimizer state, as DFlash trains) or `MaskRowEmbedding` ("mask_row").
    The nn.Embedding also reads the two-tensor form a sharded engine saves. Raises ValueError for
    another `train`."""
    if train == "mask_row":
        return MaskRowEmbedding(num_embeddings, embedding_dim, mask_token_id)
    if train not in ("all", "none"):
        raise ValueError(f"train_embeddings={train!r} must be one of {', '.join(TrainEmbeddings.values())}")
    embed = nn.Embedding(num_embeddings, embedding_dim)
    embed.mask_token_id = mask_token_id
    embed.register_load_state_dict_pre_hook(_fold_on_load)
    embed.weight.requires_grad_(train == "all")
    return embed
