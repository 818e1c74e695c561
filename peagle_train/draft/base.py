"""What every draft head shares (`DraftHead`), and the pieces its layers and proposals share.

A head (draft/peagle.py PEagleDraft and Eagle3Draft, draft/dflash.py DFlashDraft) is a DraftHead:
    config        its DraftConfig (draft/head_config.py): sizes, choices, its speculators format
    embed_tokens  the target's token embeddings [V, H] (every row trainable, or only the mask
                  token's: draft/embedding.py)
    fc            Linear(n·T → H, no bias) over the n concatenated aux hidden states (built by the head)
    norm, lm_head final RMSNorm, Linear(H → V_draft)
    d2t, t2d      draft-vocabulary buffers (data.vocab.DraftVocab)
    rotary_emb    RoPE of the target's positions; its buffers are non-persistent, so it is in no
                  state dict (checkpoints and exports hold weights only)
and answers `init_from_target`, `logits`, `draft_to_target` and `propose` (K draft tokens).
Module names follow transformers' Llama, so exports load in vLLM and speculators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from .head_config import DraftConfig
from .embedding import token_embedding

_FLEX = {}


def flex_attention_for(device: torch.device):
    """flex_attention, compiled on CUDA (fused kernel); eager elsewhere (exact, unfused)."""
    key = device.type
    if key not in _FLEX:
        _FLEX[key] = torch.compile(flex_attention, dynamic=True) if key == "cuda" else flex_attention
    return _FLEX[key]


class DraftMLP(nn.Module):
    """A Llama/Qwen3 SwiGLU MLP: [.., H] → [.., H] through `intermediate_size`."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class Proposal:
    """What `propose` returns: tokens [B, K] target ids; logits [B, K, V_draft] the draft logits
    they were picked from; cache the draft's cache of the real pairs (the SlotCache passed in, or
    per-layer (k, v)); forwards the
    number of draft forwards it took (1 for P-EAGLE, K for EAGLE-3)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    cache: list
    forwards: int


class DraftHead(nn.Module):
    """Base of the draft heads. See the module docstring for what every head holds.

    The constructor builds `embed_tokens`; a head then builds its input and layers and calls
    `add_output_layers` (the order fixes the random init stream of a seed)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = token_embedding(cfg.vocab_size, cfg.hidden_size, cfg.mask_token_id, cfg.train_embeddings)

    def add_output_layers(self) -> None:
        """`norm`, `lm_head` [V_draft, H], the draft-vocabulary buffers d2t [V_draft] int64 and
        t2d [V] bool, and `rotary_emb`."""
        cfg = self.config
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())

    @staticmethod
    def weights_only(state_dict: dict) -> dict:
        """`state_dict` without `rotary_emb`'s buffers: a module's own state dict never holds them
        (non-persistent), but a state dict gathered by a sharded engine may."""
        return {k: v for k, v in state_dict.items() if not k.startswith("rotary_emb.")}

    @torch.no_grad()
    def init_from_target(self, target_model, draft_ids: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy the target's embeddings (the mask token's row included) and its lm_head rows of the
        draft vocabulary (draft_ids [V_draft] target ids; DESIGN.md §3), and the vocabulary buffers."""
        self.embed_tokens.load_state_dict({"weight": target_model.get_input_embeddings().weight})
        self.lm_head.weight.copy_(target_model.get_output_embeddings().weight[draft_ids])
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_linears(self, std: float) -> None:
        """Redraw the weights of the head's own linear layers (every nn.Linear but `lm_head`, which
        holds the target's rows) from N(0, std²), biases zero: Hugging Face's `_init_weights` with
        `initializer_range` std, the init speculators' heads get. The draws continue the global CPU
        random stream inside `torch.random.fork_rng`, so what follows them (the rows' order, the COD
        draws) is the same whatever `std`."""
        with torch.random.fork_rng(devices=[]):
            for module in self.modules():
                if isinstance(module, nn.Linear) and module is not self.lm_head:
                    module.weight.normal_(0.0, std)
                    if module.bias is not None:
                        module.bias.zero_()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., V_draft] from pre-norm hidden states [.., H]."""
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_token: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary indices to target ids: j + d2t[j]."""
        return draft_token + self.d2t[draft_token]

    def propose(self, tokens, features, position_ids, mask, cache, K: int, pick=None) -> Proposal:
        """K draft tokens per row after the new real pairs (tokens [B, M], features [B, M, n·T]);
        see each head's `propose`. Returns a Proposal."""
        raise NotImplementedError
