"""Regeneration's serving backends (`peagle regenerate regenerate.backend=vllm|endpoint`): vLLM's
offline engine in its own environment (`VllmBackend`), and any OpenAI-compatible
/v1/chat/completions server (`EndpointBackend`: vLLM, SGLang); the replay, the resumable output and
the prompt rendering are data/regenerate.py's."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..data.regenerate import Generation, Sampling, decode_answer, prompt_texts
from ..errors import UserError


class VllmBackend:
    """Generation by vLLM's offline engine in its own environment (vllm_engine.py `VllmSession`):
    the prompt is rendered and tokenised here exactly as `HFBackend` (decoding/hf_backend.py) does
    (chat template with add_generation_prompt=True, template_kwargs), vLLM generates from those
    token ids with one SamplingParams per prompt (`sampling`'s temperature, top_p, top_k; the
    prompt's own seed), and the answer is decoded here (cut: vLLM's finish_reason "length"). A
    prompt of max_model_len tokens or more is not sent (vLLM would refuse the whole call): its
    Generation is too_long. The
    engine starts on the first call and stops at `close`; `max_num_seqs` sequences decode together
    (the regeneration batch: `regenerate.batch_size`, 256 by default for this backend). devices:
    the engine's CUDA_VISIBLE_DEVICES (None: this process's), tensor_parallel its GPU count
    (`regenerate.tensor_parallel`); several engines: data/regenerate_shards.py.
    `temperature` alone is shorthand for Sampling(temperature, seed=seed) when sampling is None."""

    def __init__(self, target_dir: str, tokenizer, eos: set[int], *, python: str, log_path: Path,
                 max_new_tokens: int = 512, temperature: float = 0.0, template_kwargs: dict | None = None,
                 dtype: str = "bfloat16", max_model_len: int = 4096, threads: int | None = None, seed: int = 0,
                 max_num_seqs: int = 16, sampling: Sampling | None = None, devices: str | None = None,
                 tensor_parallel: int = 1):
        self.tok, self.eos = tokenizer, set(eos)
        self.sampling = sampling or Sampling(temperature=float(temperature), seed=seed)
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, self.sampling.temperature, self.sampling.seed
        self.template_kwargs = dict(template_kwargs or {})
        self._args = dict(target_dir=target_dir, python=python, log_path=log_path, dtype=dtype,
                          max_model_len=max_model_len, threads=threads, max_num_seqs=max_num_seqs,
                          devices=devices, tensor_parallel=tensor_parallel)
        self._session = None
        self.generated_tokens = 0

    def generate(self, conversations: list[list[dict]], seeds: list[int] | None = None) -> list[Generation]:
        """conversations: message lists ending with a user turn; seeds: one per conversation (None =
        the sampling's seed for every prompt). Returns one Generation each."""
        from .vllm_engine import VllmSession

        texts = prompt_texts(self.tok, conversations, self.template_kwargs)
        prompts = self.tok(texts, add_special_tokens=False)["input_ids"]
        fits = [i for i, p in enumerate(prompts) if len(p) < self._args["max_model_len"]]  # room for one token
        gens = [Generation("", too_long=True) for _ in prompts]
        if not fits:
            return gens
        if self._session is None:
            self._session = VllmSession(**self._args)
        s = self.sampling
        outs = self._session.generate([prompts[i] for i in fits], max_new_tokens=self.max_new_tokens,
                                      stop_token_ids=self.eos, temperature=s.temperature, seed=s.seed, top_p=s.top_p,
                                      top_k=s.top_k, seeds=[seeds[i] for i in fits] if seeds is not None else None)
        self.generated_tokens += sum(len(o["token_ids"]) for o in outs)
        for i, o in zip(fits, outs):
            gens[i] = decode_answer(self.tok, self.eos, o["token_ids"])
            if o.get("finish_reason") is not None:
                gens[i].cut = o["finish_reason"] == "length"
        return gens

    def summary(self) -> dict:
        """vLLM's version, the engine's devices, start seconds, generate seconds and generated tokens so far."""
        s = self._session
        return {"vllm_version": s.info.get("vllm_version") if s else None, "devices": self._args["devices"],
                "load_seconds": s.info.get("load_seconds") if s else None,
                "generate_seconds": s.generate_seconds if s else 0.0, "generated_tokens": self.generated_tokens}

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class EndpointError(UserError, RuntimeError):
    """The regeneration endpoint cannot be reached or gives no answer (names the URL and the fix)."""


class EndpointBackend:
    """POST /v1/chat/completions of an OpenAI-compatible server, `concurrency` requests at a time.

    Each request carries max_tokens, the conversation's seed and temperature, top_p, top_k where
    they are set (top_k is vLLM's and SGLang's extension); one left None is left out, so the server
    applies the served model's generation_config (vLLM's and SGLang's default). Cut: finish_reason
    "length". An HTTP 400 whose body speaks of the context length (vLLM: "maximum context length",
    SGLang: "longer than the model's context length") is a prompt too long for the served model:
    Generation too_long.

    Raises:
        EndpointError (a RuntimeError and a user error: one line at the command line): the server
            cannot be reached or answers without a choice (names the URL).
    """

    def __init__(self, base_url: str, model: str, *, max_new_tokens: int = 512, temperature: float | None = 0.0,
                 concurrency: int = 8, timeout_s: float = 600.0, api_key: str | None = None,
                 template_kwargs: dict | None = None, top_p: float | None = None, top_k: int | None = None):
        self.url = base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/chat/completions") else "/chat/completions")
        self.model, self.max_new_tokens, self.temperature = model, max_new_tokens, temperature
        self.top_p, self.top_k = top_p, top_k
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self.template_kwargs = dict(template_kwargs or {})

    def _one(self, messages: list[dict], seed: int | None = None) -> Generation:
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_new_tokens}
        for k in ("temperature", "top_p", "top_k"):
            if getattr(self, k) is not None:
                body[k] = getattr(self, k)
        if seed is not None:
            body["seed"] = int(seed)
        if self.template_kwargs:  # vLLM / SGLang: arguments of the chat template, e.g. enable_thinking
            body["chat_template_kwargs"] = self.template_kwargs
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                ans = json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 400 and "context length" in e.read().decode("utf-8", "replace").lower():
                return Generation("", too_long=True)
            raise EndpointError(f"Endpoint {self.url} failed: {e}. Fix: check regenerate.endpoint_url and that "
                               "the server is up (vllm serve / sglang).") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise EndpointError(f"Endpoint {self.url} failed: {e}. Fix: check regenerate.endpoint_url and that "
                               "the server is up (vllm serve / sglang).") from e
        try:
            choice = ans["choices"][0]
            return Generation((choice["message"].get("content") or "").strip(), choice.get("finish_reason") == "length")
        except (KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"Endpoint {self.url} answered without choices[0].message: {str(ans)[:200]}. Fix: "
                                "point regenerate.endpoint_url at an OpenAI-compatible server (vllm serve / sglang).") from e

    def generate(self, conversations: list[list[dict]], seeds: list[int] | None = None) -> list[Generation]:
        """conversations: message lists ending with a user turn; seeds: one per conversation (None:
        no seed sent). Returns one Generation each, in order."""
        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as ex:
            return list(ex.map(self._one, conversations, seeds if seeds is not None else [None] * len(conversations)))
