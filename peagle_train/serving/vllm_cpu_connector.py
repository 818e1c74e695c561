"""vLLM's hidden-states connector for its CPU build (runs inside vLLM's engine; never imported by
peagle_train).

vLLM 0.32's `ExampleHiddenStatesConnector` (the store for its `extract_hidden_states` speculative
method) copies the cached states to pinned host memory on a CUDA stream, which fails on the CPU
build ("pin_memory=True requires a CUDA or other accelerator backend"). On CPU the states already
live in host memory, so this subclass writes each finished request's file synchronously and
marks it done at once; scheduling, file names, locks and the file layout (hidden_states
[T, layers, H], token_ids [T]) are the parent's. vllm_worker.py selects it through
`kv_connector_module_path` when vLLM runs on a CPU.
"""

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """Stands in for the parent's CUDA copy event: the write has already finished."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long)[None] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock a reader waits on
        self._req_copy_events[pending.req_id] = _Written()
