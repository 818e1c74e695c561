"""Regeneration's in-process backend (`peagle regenerate regenerate.backend=hf`): the target's own
answers through this package's batched engine (greedy) or HF `generate` (sampled, each row with its
own seed); the replay, the resumable output and the prompt rendering are data/regenerate.py's."""

from __future__ import annotations

import torch

from ..data.regenerate import Generation, Sampling, as_list, decode_answer, prompt_texts


class RowSampler:
    """A logits processor for HF `generate` that samples each row with its own `torch.Generator`
    (seeded per conversation and turn), so a row's answer does not depend on the rows beside it.

    scores [B, V] → temperature, then top-k, then top-p (transformers' warpers, in the order HF's
    sampling applies them), one `torch.multinomial` draw per row with that row's generator; the
    returned scores are -inf except 0 at the drawn token, so the greedy step of `generate` keeps it.
    """

    def __init__(self, sampling: Sampling, seeds: list[int]):
        from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                            TopKLogitsWarper, TopPLogitsWarper)

        warpers = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k > 0:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        self.warp = LogitsProcessorList(warpers)
        self.seeds, self.generators = [int(s) for s in seeds], None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:  # on the logits' device (a draw on CUDA stays there)
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(self.warp(input_ids, scores.float()), dim=-1)  # [B, V]
        drawn = torch.stack([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)


class HFBackend:
    """Greedy (temperature 0) or sampled generation with an in-process HF causal LM. Greedy batches
    use shared forwards with finished rows leaving the batch (`decoding.engine`; HF `generate`
    runs a batch until its longest answer); sampling uses HF `generate` with left padding and a
    `RowSampler` (temperature, top_k, top_p of `sampling`; row i drawn with seeds[i]). The prompt
    is the tokenizer's chat template with add_generation_prompt=True.

    sampling: a `Sampling` (data/regenerate.py); `temperature` alone is shorthand for
    Sampling(temperature) when sampling is None."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 512, temperature: float = 0.0,
                 sampling: Sampling | None = None, template_kwargs: dict | None = None):
        self.model, self.tok = model, tokenizer
        self.sampling = sampling or Sampling(temperature=float(temperature))
        self.max_new_tokens = max_new_tokens
        self.template_kwargs = dict(template_kwargs or {})
        self.eos = {self.tok.eos_token_id} | set(as_list(getattr(self.model.generation_config, "eos_token_id", None)))
        self.eos.discard(None)
        self._target = None

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]], seeds: list[int] | None = None) -> list[Generation]:
        """conversations: message lists ending with a user turn; seeds: one per conversation (sampled
        draws; None = the sampling's seed for every row). Returns one Generation each."""
        texts = prompt_texts(self.tok, conversations, self.template_kwargs)
        if self.sampling.greedy:
            from .engine import generate
            from ..target.capture import FeatureTarget

            if self._target is None:
                self._target = FeatureTarget(self.model)
            prompts = self.tok(texts, add_special_tokens=False)["input_ids"]
            res = generate(self._target, None, prompts, 0, self.max_new_tokens, self.eos)
            return [self._answer(r.tokens) for r in res]
        from transformers import GenerationConfig, LogitsProcessorList

        side, self.tok.padding_side = self.tok.padding_side, "left"
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        try:
            enc = self.tok(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(self.model.device)
        finally:
            self.tok.padding_side = side
        seeds = list(seeds) if seeds is not None else [self.sampling.seed] * len(texts)
        cfg = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad,
                               eos_token_id=sorted(self.eos))  # the draw is RowSampler's, greedy keeps it
        out = self.model.generate(**enc, generation_config=cfg,
                                  logits_processor=LogitsProcessorList([RowSampler(self.sampling, seeds)]))
        return [self._answer(row) for row in out[:, enc["input_ids"].shape[1]:].tolist()]

    def _answer(self, row: list[int]) -> Generation:
        return decode_answer(self.tok, self.eos, row)
