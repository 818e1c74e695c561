"""The speculators library's PEagleDraftModel training step, timed at one size (runs in the
speculators venv: `scripts/check_speculators.sh` builds one; `benchmarks/bench_draft.py` calls this).

    .venv-speculators/bin/python benchmarks/bench_speculators_step.py '{"n": 2048, "layers": 1, "max_anchors": null}'
    .venv-speculators/bin/python benchmarks/bench_speculators_step.py '[{"n": 512, "layers": 1}, {"n": 512, "layers": 4}]'

SmolLM2-135M sizes, random weights and features, K = 8, r = 0.8, r_min = 0.2, forward KL
(speculators' `kl_div`; its fused Triton implementation on CUDA, eager on CPU), fp32; the library's own COD sampling and mask
(FlexAttention's `create_block_mask` where its backward runs, else `draft_attn_impl=sdpa`, a dense
bool mask: FlexAttention has no backward on CPU). Prints one JSON line: step seconds (median),
tokens/s, peak memory (MB: CUDA max allocated, CPU peak RSS growth), elements on the COD axis.
"""

import json
import resource
import statistics
import sys
import time

import torch
from transformers import LlamaConfig

from forking import forked  # benchmarks/forking.py, shared with bench_draft.py
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig


def model(layers: int, impl: str, device: str):
    tl = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                     max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=False)
    tl._attn_implementation = impl
    cfg = PEagleSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=8192, eagle_aux_hidden_state_layer_ids=[2, 15, 27],
        mask_token_id=49151,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=8)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                                    architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    return PEagleDraftModel(cfg).to(device).train()


def main(spec: dict) -> dict:
    n, layers, max_anchors = spec["n"], spec["layers"], spec.get("max_anchors")
    device = spec.get("device", "cpu")
    repeats, warmup = spec.get("repeats", 2), spec.get("warmup", 1)
    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    impl = "simple_flex_attention" if device == "cuda" else "sdpa"
    m = model(layers, impl, device)
    g = torch.Generator().manual_seed(0)
    batch = dict(hidden_states=torch.randn(1, n, 1728, generator=g).to(device),
                 input_ids=torch.randint(0, 49152, (1, n), generator=g).to(device),
                 document_ids=torch.zeros(1, n, dtype=torch.long, device=device),
                 loss_mask=torch.ones(1, n, device=device),
                 verifier_last_hidden_states=torch.randn(1, n, 576, generator=g).to(device))
    loss_config = resolve_loss_config("kl_div", "fused" if device == "cuda" else "eager")  # fused needs Triton
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, elements = [], 0
    for i in range(warmup + repeats):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, loss, metrics = m(**batch, loss_config=loss_config, max_anchors=max_anchors, num_depths=8,
                             down_sample_ratio=0.8, down_sample_ratio_min=0.2)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    from speculators.models.peagle.data import generate_cod_sample_indices

    torch.manual_seed(0)
    a, _ = generate_cod_sample_indices(n, batch["loss_mask"], 8, 0.8, 0.2, max_anchors=max_anchors)
    elements = int(a.numel())
    peak = ((torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    t = statistics.median(times)
    return {"n": n, "layers": layers, "max_anchors": max_anchors, "elements": elements, "step_s": t,
            "tokens_per_s": n / t, "peak_mb": peak, "attn_impl": impl}


if __name__ == "__main__":
    arg = json.loads(sys.argv[1])  # one spec, or a list of specs (each forked on CPU)
    if isinstance(arg, dict):
        print(json.dumps(main(arg)), flush=True)
    else:
        torch.set_num_threads(arg[0].get("threads", 1) if arg else 1)
        for spec in arg:
            print(json.dumps({**spec, **forked(main, spec)} if spec.get("device", "cpu") == "cpu" else main(spec)), flush=True)
