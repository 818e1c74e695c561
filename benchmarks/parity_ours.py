"""Our side of the peer-parity benchmark (benchmarks/bench_parity.py): `peagle train` itself, with
two records added around the trainer, so that the speculators run gets exactly our rows:

    python benchmarks/parity_ours.py PARITY_DIR recipe=... features.source=offline features.dir=... output_dir=...

- while training, each packed row the trainer trains on (`Trainer._row`, in step order) is digested
  (`parity_speculators.row_digest`); the seconds spent digesting are measured (bench_parity.py
  takes them out of the training time);
- after `Trainer.fit` has returned (outside its clock), the same rows are built again by the same
  `Trainer._row` and written to PARITY_DIR/rows/ (the format parity_speculators.py reads), with the
  target's final hidden states of each position (offline features only:
  `OfflineFeatures.document`), and d2t / t2d to PARITY_DIR/d2t_t2d.safetensors;
  PARITY_DIR/ours.json records the digests of both passes, the digest seconds, whether the
  final states give back the row's target logits exactly, and the head's trainable parameters.
Raises SystemExit for online features (the final states are not stored) or grad_accum > 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_speculators import row_digest  # noqa: E402  (the one digest both sides compute)

from peagle_train.features.rows import TargetLogitsAt  # noqa: E402
from peagle_train.features.shards import OfflineFeatures  # noqa: E402
from peagle_train.training.trainer import Trainer  # noqa: E402


def digest_of(row) -> str:
    """`row_digest` of a PackedRow (tokens, features, valid, doc_ids, pos_ids)."""
    return row_digest(row.tokens, row.features, row.valid, row.doc_ids, row.pos_ids)


def row_tensors(trainer, g: int) -> dict[str, torch.Tensor]:
    """Row g of `trainer` as the rows directory holds it (parity_speculators.py), built by `Trainer._row`,
    plus `targets_equal`: whether `logits_from_final` of the stored final states equals the row's
    target logits. Features are stored in bf16 when that is lossless (bf16 shards), else fp32."""
    doc_indices = trainer.batches[g]
    row, _ = trainer._row(doc_indices)
    finals = torch.cat([trainer.features.document(i)[2][1:] for i in doc_indices])
    if isinstance(row.target_logits, TargetLogitsAt):  # computed from these very states where indexed
        same = torch.equal(row.target_logits.finals, finals)
    else:
        with trainer.target_amp:
            same = torch.equal(trainer.target.logits_from_final(finals, trainer.draft_ids), row.target_logits)
    feats = row.features.float()
    if torch.equal(feats.bfloat16().float(), feats):
        feats = feats.bfloat16()
    fin = finals.float()
    return {"input_ids": row.tokens.long(), "hidden_states": feats, "loss_mask": row.valid.bool(),
            "document_ids": row.doc_ids.long(), "position_ids": row.pos_ids.long(),
            "verifier_last_hidden_states": fin.bfloat16() if torch.equal(fin.bfloat16().float(), fin) else fin,
            "targets_equal": torch.tensor(same)}


def write_rows(trainer, steps: int, parity_dir: Path) -> dict:
    """The rows directory (parity_dir/rows: g.safetensors per row g < `steps`, then index.json) and
    d2t_t2d.safetensors of `trainer`. Returns {"digests", "targets_equal"} of the written rows."""
    from safetensors.torch import save_file

    rows_dir = parity_dir / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    digests, equal = [], True
    for g in range(steps):
        t = row_tensors(trainer, g)
        equal = equal and bool(t.pop("targets_equal"))
        digests.append(row_digest(t["input_ids"], t["hidden_states"], t["loss_mask"], t["document_ids"],
                                  t["position_ids"]))
        save_file({k: v.contiguous() for k, v in t.items()}, str(rows_dir / f"{g}.safetensors"))
    (rows_dir / "index.json").write_text(json.dumps({"rows": steps}))
    draft = trainer.draft
    save_file({"d2t": draft.d2t.detach().cpu().long().contiguous(), "t2d": draft.t2d.detach().cpu().bool().contiguous()},
              str(parity_dir / "d2t_t2d.safetensors"))
    return {"digests": digests, "targets_equal": equal}


def install(parity_dir: Path) -> dict:
    """Wrap `Trainer._row` (digest each row, timed) and `Trainer.fit` (then write the rows and
    ours.json). Returns the record dict the wrappers fill."""
    record = {"digests": [], "digest_seconds": 0.0}
    row, fit = Trainer._row, Trainer.fit

    def digesting_row(self, doc_indices):
        out = row(self, doc_indices)
        t0 = time.perf_counter()
        record["digests"].append(digest_of(out[0]))
        record["digest_seconds"] += time.perf_counter() - t0
        return out

    def fit_then_write(self):
        if not isinstance(self.features, OfflineFeatures) or (self.training.get("grad_accum") or 1) != 1:
            raise SystemExit("parity_ours.py: needs features.source=offline and training.grad_accum=1")
        res = fit(self)
        Trainer._row = row  # the rows are written without digesting twice
        trained = record["digests"][:res["steps"]]  # validation rows (if any) are not training rows
        record.update(write_rows(self, res["steps"], parity_dir))  # digests: those of the written rows
        record.update(trained_digests=trained, steps=res["steps"], tokens=res["tokens"], seconds=res["seconds"],
                      trainable=[n for n, p in self.draft.named_parameters() if p.requires_grad])
        (parity_dir / "ours.json").write_text(json.dumps(record, indent=1))
        return res

    Trainer._row, Trainer.fit = digesting_row, fit_then_write
    return record


if __name__ == "__main__":
    target_dir = Path(sys.argv[1])
    target_dir.mkdir(parents=True, exist_ok=True)
    install(target_dir)
    from peagle_train.cli.train import run

    sys.argv = ["peagle train", *sys.argv[2:]]
    run(sys.argv[1:])
