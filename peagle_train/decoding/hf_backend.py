"""Regeneration's in-process backend (`peagle regenerate regenerate.backend=hf`): the target's own
answers through this package's batched engine (greedy) or HF `generate` (sampled); the replay, the
resumable output and the prompt rendering are data/regenerate.py's."""

from __future__ import annotations

import torch

from ..data.regenerate import Generation, as_list, decode_answer, prompt_texts


class HFBackend:
    """Greedy (temperature 0) or sampled generation with an in-process HF causal LM. Greedy batches
    use shared forwards with finished rows leaving the batch (`decoding.engine`; HF `generate`
    runs a batch until its longest answer); sampling uses
    HF `generate` with left padding. The prompt is the tokenizer's chat template with
    add_generation_prompt=True."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 512, temperature: float = 0.0,
                 template_kwargs: dict | None = None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.template_kwargs = dict(template_kwargs or {})
        self.eos = {self.tok.eos_token_id} | set(as_list(getattr(self.model.generation_config, "eos_token_id", None)))
        self.eos.discard(None)
        self._target = None

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]]) -> list[Generation]:
        """conversations: message lists ending with a user turn. Returns one Generation each."""
        texts = prompt_texts(self.tok, conversations, self.template_kwargs)
        if self.temperature <= 0:
            from .engine import generate
            from ..target.capture import FeatureTarget

            if self._target is None:
                self._target = FeatureTarget(self.model)
            prompts = self.tok(texts, add_special_tokens=False)["input_ids"]
            res = generate(self._target, None, prompts, 0, self.max_new_tokens, self.eos)
            return [self._answer(r.tokens) for r in res]
        side, self.tok.padding_side = self.tok.padding_side, "left"
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        try:
            enc = self.tok(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(self.model.device)
        finally:
            self.tok.padding_side = side
        sample = self.temperature > 0
        out = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=sample, pad_token_id=pad,
                                  **({"temperature": self.temperature, "top_p": 1.0} if sample else {}))
        return [self._answer(row) for row in out[:, enc["input_ids"].shape[1]:].tolist()]

    def _answer(self, row: list[int]) -> Generation:
        return decode_answer(self.tok, self.eos, row)
