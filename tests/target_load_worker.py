"""One launched process's view of the target load under ZeRO-3 or FSDP (tests/integration/test_target_load.py).

    python tests/target_load_worker.py zero3|fsdp TARGET_DIR      (MASTER_PORT: a free port)

zero3: a 1-process gloo group and Accelerate's DeepSpeedPlugin(zero_stage=3) selected, as
AcceleratorState does under `accelerate launch --use_deepspeed --zero_stage 3` on GPUs (it registers
transformers' HfDeepSpeedConfig). fsdp: the environment `accelerate launch --use_fsdp` gives the
second process of a node (ACCELERATE_USE_FSDP, FSDP_CPU_RAM_EFFICIENT_LOADING=true, LOCAL_RANK=1).
Loads TARGET_DIR with peagle_train's `load_target`, then a plain one-process load of it (no ZeRO-3,
no FSDP) as the reference, and prints one JSON line: per parameter and buffer of the target, whether it is on the
meta device, a ZeRO-3 placeholder, and equal (shape and values) to the plain load; and whether the
launcher's settings are back after the load.
"""

from __future__ import annotations

import json
import os
import sys


def main(mode: str, target: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    if mode == "zero3":
        os.environ["LOCAL_RANK"] = "0"
        dist.init_process_group("gloo")
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(zero_stage=3)
        plugin.select(_from_accelerator_state=True)  # AcceleratorState's call for --use_deepspeed on a GPU
    else:
        os.environ.update(LOCAL_RANK="1", ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
        dist.init_process_group("gloo")
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as hf_deepspeed
    from transformers.integrations import is_deepspeed_zero3_enabled, is_fsdp_enabled

    from peagle_train.target.load import load_target

    launcher = {"zero3": is_deepspeed_zero3_enabled(), "fsdp": is_fsdp_enabled()}
    model, _ = load_target(target)
    restored = {"zero3": is_deepspeed_zero3_enabled(), "fsdp": is_fsdp_enabled()} == launcher

    hf_deepspeed.unset_hf_deepspeed_config()
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    plain = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    plain = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    tensors = {}
    for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        tensors[name] = {"meta": t.is_meta, "partitioned": hasattr(t, "ds_id"),
                         "equal": not t.is_meta and t.shape == plain[name].shape and torch.equal(t, plain[name])}
    print(json.dumps({"launcher": launcher, "restored": restored, "tensors": tensors}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
