"""The speculators library's side of the peer-parity benchmark (benchmarks/bench_parity.py): train its
own draft model class on our packed rows with its own `Trainer`, save it with its own checkpointer.
Runs in the speculators venv (`scripts/check_speculators.sh` builds one):

    .venv-speculators/bin/python benchmarks/parity_speculators.py RUN_SPEC.json

RUN_SPEC.json (written by bench_parity.py): rows (the rows directory), config_dir (a config-only
directory: our export's config.json, the verifier path blanked), verifier (the target's local HF
directory), d2t_t2d (a safetensors file with d2t [V_draft] int64 and t2d [V] bool), algorithm
(peagle | eagle3 | dflash), hyper (lr, weight_decay, warmup_steps, schedule, num_depths,
down_sample_ratio, down_sample_ratio_min, max_anchors, ttt_decay, loss, autocast: bf16 | fp32, and
extra: DFlash's max_anchors, per_position_loss_weight, dflash_decay_gamma, dpace_alpha),
threads, seed, out (a folder: the checkpoint goes to out/checkpoint/0, speculators' own
`save_pretrained` format, which vLLM serves; DFlash's completed copy in out/export: `served_export`),
result (the JSON written at the end).

How it trains, as a user of speculators 0.9.0 would on one CPU process: the model is built by its
own config-only path (`speculators.train.cli._build_from_config_only`: fresh weights from a full
speculator config, `load_vocab_mappings`, `load_verifier_weights` from the target), the step is
`speculators.train.trainer.Trainer` (AdamW over all parameters, its scheduler, autocast to
`hidden_states_dtype`: bf16 when our run's draft autocast is bf16, else fp32 (CPU autocast then
disables itself), grad clip 1.0, one epoch over the given rows, one row per step).
What a CPU needs that its CLI does not offer: its Trainer moves the model to the local rank (an
int, i.e. CUDA), autocasts on "cuda" when no accelerator exists and its step timer calls
`torch.accelerator.synchronize` (which fails without a GPU), so the local rank is set to "cpu",
the autocast device to "cpu" and the synchronize is a no-op (nothing to wait for on a CPU); the
draft attention is `sdpa` and the loss `eager` (its FlexAttention has no CPU backward, its fused
loss needs Triton), as benchmarks/bench_speculators_step.py runs it. Its parameters that train are
its own rule (e.g. lm_head frozen): the result lists them (`trainable`).

The rows directory (parity_ours.py writes it from the rows our trainer trained on): index.json
{"rows": N} and j.safetensors for row j < N holding `input_ids` [n] int64, `hidden_states` [n, 3H]
(bf16 when lossless, else fp32), `verifier_last_hidden_states` [n, H]
(the target's final hidden states, pre-norm, aligned like the rows: speculators computes its
targets from them with the target's norm and lm_head rows of the draft vocabulary), `loss_mask`
[n] bool, `document_ids` [n] int64, `position_ids` [n] int64 (position within the document, from 0;
speculators' own data pipeline starts them at 1 after its shift, so 1 is added here). A row is
read from disk at its step, inside the training clock, as our trainer reads its offline shards. `row_digest` (standard library + torch) is the one digest both
sides compute, so bench_parity.py asserts that both trainers saw byte-identical rows.

DFlash reads the same stored rows re-laid into speculators' own layout (`dflash_layout`, after the
digest), so that its blocks are ours. Ours (peagle_train/algorithms/dflash.py): row position i holds
x_{i+1} and g_i; the block anchored at row position a has the anchor token x_{a+1} at position
pos_ids[a] + 1, sees the context g_c of row positions c ≤ a of its document, and slot j = 1..K learns
the target distribution of row position a + j - 1 (the one from final state f_{a+j}, predicting
x_{a+j+1}), loss-valid where valid[a + j - 1]. speculators' (models/dflash/core.py): the anchor p holds
input_ids[p] at position_ids[p], sees hidden_states of base positions < p of its document, slot
s = 1..block_size-1 learns verifier_last_hidden_states[p + s - 1] through the target's norm and
lm_head, loss-valid where loss_mask[p + s]; anchors are drawn where loss_mask[p]. So speculators'
anchor p = a + 1 is our block when, within each document, input_ids'[i] = input_ids[i - 1] (x_i),
verifier_last_hidden_states'[i] = the stored row's [i - 1] (f_i), loss_mask'[i] = loss_mask[i - 2]
(the mask of the token x_i), the first two positions of a document False (no anchor without a
context token of its own document; x_1 is never a label in our rows); hidden_states, document_ids and
position_ids unchanged (RoPE sees only differences, so positions from 1 give the same scores).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

DIGEST_FIELDS = ("input_ids", "hidden_states", "loss_mask", "document_ids", "position_ids")


def row_digest(input_ids, hidden_states, loss_mask, document_ids, position_ids) -> str:
    """sha256 (hex) of one packed row as both trainers read it: input_ids, document_ids,
    position_ids as int64, hidden_states as float32 [n, 3H], loss_mask as bool, each with its shape."""
    h = hashlib.sha256()
    for name, x, dt in zip(DIGEST_FIELDS, (input_ids, hidden_states, loss_mask, document_ids, position_ids),
                           (torch.int64, torch.float32, torch.bool, torch.int64, torch.int64)):
        x = x.detach().to("cpu", dt).contiguous()
        h.update(f"{name}:{tuple(x.shape)}:".encode())
        h.update(x.numpy().tobytes())
    return h.hexdigest()


def shift_in_document(x: torch.Tensor, document_ids: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x [n, ...] moved `by` ≥ 1 positions later within each document: out[i] = x[i - by] where row
    position i - by lies in i's document, else `fill`. document_ids: [n] (contiguous documents)."""
    out = torch.full_like(x, fill)
    out[by:] = x[:-by]
    same = torch.zeros(x.shape[0], dtype=torch.bool)
    same[by:] = document_ids[by:] == document_ids[:-by]
    return torch.where(same.view(-1, *[1] * (x.dim() - 1)), out, torch.full_like(x, fill))


def dflash_layout(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One stored row (the rows directory's tensors, our layout) in speculators' DFlash layout (module
    docstring): input_ids and verifier_last_hidden_states one position later within each document,
    loss_mask two (the vacated positions: token 0, zero states, False); the rest unchanged."""
    doc = t["document_ids"].long()
    return {**t, "input_ids": shift_in_document(t["input_ids"].long(), doc, 1, 0),
            "verifier_last_hidden_states": shift_in_document(t["verifier_last_hidden_states"], doc, 1, 0.0),
            "loss_mask": shift_in_document(t["loss_mask"].bool(), doc, 2, False)}


class Rows(torch.utils.data.Dataset):
    """The rows directory, read one row per item (as speculators' own data loader reads hidden
    states from disk each step): the batch dict speculators' collate makes ([1, n] and [1, n, D]
    tensors, hidden states in float32, loss_mask float, position ids from 1, `error_records` 0),
    for `algorithm` "dflash" re-laid by `dflash_layout`. Raises FileNotFoundError without index.json."""

    def __init__(self, path: str | Path, algorithm: str = "peagle"):
        self.dir = Path(path)
        self.n = int(json.loads((self.dir / "index.json").read_text())["rows"])
        self.layout = dflash_layout if algorithm == "dflash" else (lambda t: t)

    def __len__(self) -> int:
        return self.n

    def tensors(self, j: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.dir / f"{j}.safetensors"))

    def __getitem__(self, j: int) -> dict:
        t = self.layout(self.tensors(j))
        return {"input_ids": t["input_ids"].long()[None], "hidden_states": t["hidden_states"].float()[None],
                "verifier_last_hidden_states": t["verifier_last_hidden_states"].float()[None],
                "loss_mask": t["loss_mask"].float()[None], "document_ids": t["document_ids"].long()[None],
                "position_ids": t["position_ids"].long()[None] + 1, "error_records": 0}

    def digests_and_tokens(self) -> tuple[list[str], int]:
        """Each row's `row_digest`, and the token-passes (row tokens + one per document, as our
        trainer counts them), in one pass before training."""
        digests, tokens = [], 0
        for j in range(self.n):
            t = self.tensors(j)
            digests.append(row_digest(*(t[k] for k in DIGEST_FIELDS)))
            tokens += int(t["input_ids"].numel() + t["document_ids"].unique().numel())
        return digests, tokens


def build_model(spec: dict):
    """speculators' draft model of `spec["algorithm"]` from the config-only directory, through its
    own config-only path; the vocabulary maps from `spec["d2t_t2d"]`, embeddings and lm_head from the
    verifier. Returns the model (fp32, train mode)."""
    from safetensors.torch import load_file
    from speculators.model import SpeculatorModel
    from speculators.train.cli import _build_from_config_only

    import speculators.models  # noqa: F401  (registers the model classes)

    maps = load_file(spec["d2t_t2d"])
    cls = SpeculatorModel.registry[spec["algorithm"]]
    torch.manual_seed(spec.get("seed", 0))
    model = _build_from_config_only(cls, spec["config_dir"], t2d=maps["t2d"], d2t=maps["d2t"],
                                    verifier_name_or_path=spec["verifier"], draft_attn_impl="sdpa")
    return model.float().train()


def call_kwargs(algorithm: str, hyper: dict) -> dict:
    """The forward's keyword arguments, from the model class's own `get_trainer_kwargs` with our
    hyper-parameters (P-EAGLE: K_train, COD r / r_min, max_anchors; EAGLE-3: TTT steps = K_train and
    the per-step loss decay), its `eager` loss, and `hyper["extra"]` (the training arguments of its
    schema that another algorithm reads, e.g. DFlash's block size), which win."""
    from speculators.model import SpeculatorModel

    cls = SpeculatorModel.registry[algorithm]
    kw = dict(loss_fn=hyper.get("loss", "kl_div"), loss_implementation="eager", num_depths=hyper["num_depths"],
              down_sample_ratio=hyper["down_sample_ratio"], down_sample_ratio_min=hyper["down_sample_ratio_min"],
              max_anchors=hyper.get("max_anchors"), ttt_steps=hyper["num_depths"],
              ttt_step_loss_decay=hyper.get("ttt_decay", 1.0))
    kw.update(hyper.get("extra") or {})
    train_kwargs, _ = cls.get_trainer_kwargs(**kw)
    return train_kwargs


def train(spec: dict) -> dict:
    """Train on every row of the rows directory once with speculators' Trainer; its checkpoint (bf16,
    config.json + model.safetensors) goes to out/checkpoint/0. Returns the result dict: steps, tokens
    (row tokens + one per document, as our trainer counts), seconds (the Trainer's run alone),
    tokens_per_second, digests, trainable parameter names, losses, checkpoint."""
    import speculators.train.distributed as dist_state
    from speculators.train.trainer import Trainer, TrainerConfig
    from torch.utils.data import DataLoader

    torch.set_num_threads(int(spec.get("threads") or 1))
    rows = Rows(spec["rows"], spec["algorithm"])
    digests, tokens = rows.digests_and_tokens()
    model = build_model(spec)
    hyper, losses = spec["hyper"], []
    dist_state._local_rank = "cpu"  # its Trainer moves the model and batches to the local rank (else cuda:0)
    if not torch.accelerator.is_available():  # its step timer synchronizes the accelerator: none to wait for
        torch.accelerator.synchronize = lambda *a, **k: None
    out = Path(spec["out"])
    cfg = TrainerConfig(lr=hyper["lr"], num_epochs=1, save_path=str(out / "checkpoint"), optimizer="adamw",
                        weight_decay=hyper["weight_decay"], scheduler_type=hyper["schedule"],
                        scheduler_warmup_steps=hyper["warmup_steps"], scheduler_total_steps=len(rows),
                        train_call_kwargs=call_kwargs(spec["algorithm"], hyper),
                        hidden_states_dtype=torch.bfloat16 if hyper.get("autocast", "bf16") == "bf16" else torch.float32,
                        log_freq=1, max_steps=len(rows))
    loader = DataLoader(rows, batch_size=None, shuffle=False, collate_fn=lambda b: dict(b))
    trainer = Trainer(model, cfg, loader)
    trainer.device_type = "cpu"  # bf16 autocast on the CPU, as hidden_states_dtype asks
    step = model.forward

    def forward(*a, **k):
        res = step(*a, **k)
        losses.append(float(res[1].detach()))
        return res
    model.forward = forward
    t0 = time.perf_counter()
    trainer.run_training()
    seconds = time.perf_counter() - t0
    return {"trainer": "speculators", "algorithm": spec["algorithm"], "steps": len(rows), "tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / seconds, "digests": digests, "losses": losses,
            "trainable": [n for n, p in model.named_parameters() if p.requires_grad],
            "checkpoint": str(out / "checkpoint" / "0"), "speculators_version": _version(),
            "export": str(served_export(model, out / "checkpoint" / "0", out / "export"))}


def served_export(model, checkpoint: Path, dest: Path) -> Path:
    """The export that is served and read back: speculators' checkpoint itself, or for DFlash a copy
    (dest) with the tensors its save leaves to the runtime added: embed_tokens.weight and, for the full
    vocabulary, lm_head.weight, the target's own (the model's frozen copies, never trained), in the
    checkpoint's float dtype. vLLM would take those from the target; our loader and validator read
    them from the export. Returns the directory to serve."""
    import shutil

    from safetensors.torch import load_file, save_file

    sd = load_file(str(checkpoint / "model.safetensors"))
    missing = {k: p for k, p in (("embed_tokens.weight", model.embed_tokens.weight),
                                 ("lm_head.weight", model.lm_head.weight)) if k not in sd}
    if model.config.speculators_model_type != "dflash" or not missing:
        return checkpoint
    dtype = sd["fc.weight"].dtype
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(checkpoint / "config.json", dest / "config.json")
    sd.update({k: p.detach().to("cpu", dtype).contiguous() for k, p in missing.items()})
    save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _version() -> str:
    from importlib.metadata import version

    return version("speculators")


if __name__ == "__main__":
    run_spec = json.loads(Path(sys.argv[1]).read_text())
    result = train(run_spec)
    Path(run_spec["result"]).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("digests", "losses", "trainable")}))
