"""Running an acceptance evaluation: every prompt (every turn) decoded with the target alone, the
head and an optional baseline head by the decoding engine, in the same run and precision, with
per-prompt results appended to out_dir/results.jsonl as they finish, so that a killed run resumes.

Resume: results.jsonl holds one JSON line per (benchmark, id, turn, decoder) with the tokens,
accepted counts, forward counts and wall times of that decoding; results.meta.json holds the
settings and head fingerprints they were decoded with. A rerun into the same out_dir reads them,
decodes only the missing (benchmark, id, turn, decoder) keys, and writes acceptance.json from the
stored results, so it equals the uninterrupted run's. A partial last line (a kill during a write)
is dropped and counted; a damaged line before it is refused, naming the line. Results of other
settings or heads are never mixed in: they are moved aside to results.stale.jsonl (a warning names
what differs), the report files of that run to *.stale.*, and the run starts over. The report
(report.py `write_report`) is written file by file, acceptance.json last, recording the others'
sha256.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..decoding.engine import GenerationResult, generate
from ..errors import CorruptFileError, UserError, read_json
from ..io import atomic_write_text
from ..precision import ResolvedPrecision, as_resolved, log_precision, short_name
from .benchmarks import BenchmarkError, chat_ids
from .report import _tau, format_acceptance, summarize, write_report
from .settings import EvalSettings

logger = logging.getLogger(__name__)


class HeadMismatchError(UserError, ValueError):
    """A draft head that was trained for another target; the message names every mismatch."""


def check_head_target(draft, target, tokenizer=None, head_name: str = "head") -> None:
    """Refuse a head trained for another target: what `DraftConfig.check_target` checks (hidden
    size, vocabulary, aux layer ids inside the target), plus what only a decoding run can see: aux
    layer ids equal to those the FeatureTarget captures, a draft context no shorter than the
    target's, and a mask token the tokenizer does not use as a special token.

    Raises HeadMismatchError listing every mismatch with the fix."""
    c, tc, problems = draft.config, target.config, []
    try:
        c.check_target(tc)
    except ValueError as e:
        problems.append(str(e).split(": ", 1)[-1])
    if list(c.aux_layer_ids) != list(target.aux_layer_ids):
        problems.append(f"layer ids: the head was trained on aux layers {list(c.aux_layer_ids)}, the target gives "
                        f"{list(target.aux_layer_ids)} (of {tc.num_hidden_layers} layers)")
    if c.max_position_embeddings < getattr(tc, "max_position_embeddings", 0):
        problems.append(f"context: the head's max_position_embeddings {c.max_position_embeddings} < the target's "
                        f"{tc.max_position_embeddings}")
    if c.masked and tokenizer is not None:
        used = {int(i) for i in (tokenizer.all_special_ids or [])}
        if c.mask_token_id in used:
            problems.append(f"mask token: mask_token_id={c.mask_token_id} "
                            f"({tokenizer.convert_ids_to_tokens(c.mask_token_id)!r}) is a special token of this target's tokenizer")
        elif c.mask_token_id >= len(tokenizer):
            problems.append(f"mask token: mask_token_id={c.mask_token_id} is outside the tokenizer ({len(tokenizer)} ids)")
    if problems:
        raise HeadMismatchError(f"{head_name} was trained for another target: " + "; ".join(problems)
                                + ". Fix: evaluate it with the target it was trained for (its checkpoint's `target`).")


def prepare_for_decoding(target, heads: list, precision: ResolvedPrecision | str = "auto"):
    """Put the target (in place) and copies of the heads in the dtype of `precision` (the command's
    ResolvedPrecision, logged here and taken as it is; a setting auto | fp32 | bf16 is resolved on
    the target's device: peagle_train/precision.py `as_resolved`), so that any mix of target dtype
    and head dtype decodes. Returns (ResolvedPrecision, [head copies]) (None
    stays None); the heads given are left as they are (a trained head keeps its fp32 weights).
    The target and the copies then go through the optional CPU plug-in (peagle_train/accel/cpu
    `accelerate_for_decoding`: in bf16 on CPU, packed linears, fused norms and the AMX attention;
    the same outputs, faster at decoding shapes; PEAGLE_AMX=0 leaves transformers')."""
    from ..accel.cpu import accelerate_for_decoding  # the CPU plug-in: loaded only when evaluation decodes

    dev = target.model.device
    res = as_resolved(precision, dev)
    log_precision(res)
    target.model.to(res.dtype)
    accelerate_for_decoding(target.model)
    copies = [None if h is None else copy.deepcopy(h).to(device=dev, dtype=res.dtype).eval() for h in heads]
    for h in copies:
        if h is not None:
            accelerate_for_decoding(h)
    return res, copies


def head_fingerprint(head) -> str:
    """sha256 (16 hex) of a head's config and weights: resume refuses results of another head."""
    h = hashlib.sha256(json.dumps(head.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(head.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _key(rec: dict) -> tuple:
    return (str(rec["benchmark"]), str(rec["id"]), int(rec["turn"]), rec["decoder"])


REPORT_FILES = (("acceptance.json", "acceptance.stale.json"), ("per_prompt.csv", "per_prompt.stale.csv"),
                ("acceptance.png", "acceptance.stale.png"))  # report.write_report's files, and where a new start moves them


class ResultLog:
    """out_dir/results.jsonl: the per-(benchmark, id, turn, decoder) results, appended and flushed
    as they finish; read back on resume (module docstring). results.meta.json (the settings) is
    written atomically before the first result. A partial last line (a kill while writing it) is cut
    off and counted (`torn`, logged); a damaged line before it, or a damaged results.meta.json, is
    refused (CorruptFileError naming the file, the line and the fix). Results of other settings, or
    without their settings file, are moved to results.stale.jsonl, and the report files of that
    run to *.stale.* (`REPORT_FILES`), before the run starts over."""

    def __init__(self, out_dir: Path, meta: dict):
        self.path, meta_path = out_dir / "results.jsonl", out_dir / "results.meta.json"
        self.done: dict[tuple, dict] = {}
        self.torn = 0
        fix = (f"move {self.path} and {meta_path} aside (or choose another output_dir), then run the same command "
               "again: it decodes every result again")
        has_results = self.path.is_file() and self.path.stat().st_size > 0
        old = read_json(meta_path, "settings of the results in results.jsonl", fix=fix) \
            if has_results and meta_path.is_file() else None
        if has_results and old != meta:
            diff = "no results.meta.json" if old is None else \
                {k: (old.get(k), meta.get(k)) for k in set(old) | set(meta) if old.get(k) != meta.get(k)}
            stale = out_dir / "results.stale.jsonl"
            logger.warning("%s was decoded with other settings or heads %s (old, new): moved to %s with its report "
                           "(*.stale.*), starting over", self.path, diff, stale)
            self.path.replace(stale)
            for name, aside in REPORT_FILES:
                if (out_dir / name).is_file():
                    (out_dir / name).replace(out_dir / aside)
            has_results = False
        atomic_write_text(meta_path, json.dumps(meta, indent=2, sort_keys=True))
        if has_results:
            self._read(fix)
        else:
            self.path.write_text("")
        self.reused = len(self.done)
        self._f = open(self.path, "a")

    def _read(self, fix: str) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # a line cut by a kill has no newline: cut it off, count it
        for n, line in enumerate(data[:end].split(b"\n")[:-1], 1):
            try:
                rec = json.loads(line)  # bytes: UTF-8, a damaged byte raises
                self.done[_key(rec)] = rec
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise CorruptFileError(f"{self.path}, line {n}: not a complete result ({type(e).__name__}: "
                                       f"{str(e)[:120]}): the file is damaged. Fix: {fix}.") from e
        if end < len(data):
            self.torn = 1
            os.truncate(self.path, end)
            logger.warning("%s: its last line was cut off (%d bytes without a newline: a run stopped while writing "
                           "it); dropped, 1 result to decode again", self.path, len(data) - end)

    def add(self, rec: dict) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done[_key(rec)] = rec

    def close(self) -> None:
        self._f.close()


def _record(benchmark: str, q: dict, turn: int, decoder: str, prompt_tokens: int, r: GenerationResult) -> dict:
    return {"benchmark": benchmark, "id": q["id"], "turn": turn, "decoder": decoder, "category": q["category"],
            "prompt_tokens": prompt_tokens, **asdict(r)}


def _result(rec: dict) -> GenerationResult:
    return GenerationResult(**{k: rec[k] for k in GenerationResult.__dataclass_fields__})


MORE_HEAD = "more_head_"  # decoder names of the further heads: more_head_1, more_head_2, ...


def _prefix(name: str) -> str:
    """The per_prompt.csv column prefix of a decoder: target, head, baseline, more1, more2, ..."""
    if name.startswith(MORE_HEAD):
        return "more" + name[len(MORE_HEAD):]
    return {"target": "target", "head": "head", "baseline_head": "baseline"}[name]


def _row(q: dict, turn: int, prompt_tokens: int, res: dict[str, GenerationResult], greedy: bool,
         checked: bool = True) -> dict:
    """One per_prompt.csv row for a turn from its results per decoder. Lossless compares with the
    "reference" decoder (the target alone in the verifier's numerics) where there is one, else
    with the target alone; with `checked` False (below fp32 in batches, report.py) it is None and
    `equals_target_alone` only records whether the outputs are equal."""
    b, s = res["target"], res["head"]
    ref = res.get("reference", b)
    row = {"id": q["id"], "category": q["category"], "turn": turn, "prompt_tokens": prompt_tokens,
           "new_tokens": len(s.tokens), "verify_steps": len(s.accepted), "tau": _tau(s.accepted),
           "lossless": (s.tokens == ref.tokens) if greedy and checked else None,
           **({"equals_target_alone": s.tokens == b.tokens} if greedy and not checked else {}),
           **({"equals_one_token_target": s.tokens == b.tokens} if "reference" in res and greedy else {}),
           "draft_forwards": s.draft_forwards, "target_forwards": s.target_forwards,
           "spec_seconds": round(s.seconds, 4), "target_only_seconds": round(b.seconds, 4)}
    for name, r in res.items():
        if name == "baseline_head" or name.startswith(MORE_HEAD):
            pre = _prefix(name)
            row.update({f"{pre}_tau": _tau(r.accepted), f"{pre}_new_tokens": len(r.tokens),
                        f"{pre}_lossless": (r.tokens == ref.tokens) if greedy and checked else None,
                        f"{pre}_seconds": round(r.seconds, 4)})
    for name, r in res.items():
        if name == "reference":
            continue
        pre = _prefix(name)
        row.update({f"{pre}_ttft_s": round(r.first_token_seconds, 5),
                    f"{pre}_tpot_s": round(r.time_per_output_token, 5), f"{pre}_latency_s": round(r.seconds, 4)})
    return row


WARMUP_TOKENS = 16  # new tokens of the untimed warm-up decode each decoder runs before the timed ones


def check_unique_ids(prompts: list[dict], benchmark: str = "prompts") -> None:
    """Refuse prompts that share an id: results are keyed by (benchmark, id, turn, decoder), so a
    repeated id would be decoded once and its result reported for every prompt that has it.

    Raises BenchmarkError naming the id and the positions of the prompts that share it."""
    first: dict[str, int] = {}
    for n, q in enumerate(prompts):
        key = str(q["id"])
        if key in first:
            raise BenchmarkError(f"{benchmark}: prompts {first[key] + 1} and {n + 1} share the id {q['id']!r}; results "
                                 "are keyed by id, so one would be decoded and reported twice. Fix: give every prompt a "
                                 "unique 'id'.")
        first[key] = n


def evaluate_acceptance(target, draft, tokenizer, prompts: list[dict], settings: EvalSettings, *,
                        out_dir: str | Path, baseline_draft=None, baseline_target=None,
                        train_metrics: dict | None = None, precision: ResolvedPrecision | str | None = None,
                        more_heads: list[tuple] | None = None) -> dict:
    """Decode every prompt (every turn) with the target alone, with `draft`, with `baseline_draft`
    (optional, e.g. an EAGLE-3 head) and with each of `more_heads` (optional [(name, head, target
    or None)], e.g. a DFlash head beside P-EAGLE and EAGLE-3) and measure; resumable (module docstring).

    prompts: dicts {id, category, turns: [str]} or {id, category, messages: [{role, content}]}
    (a bare {prompt} is one turn), or {id, category, input_ids: [int]} (one turn, already
    tokenised; no tokenizer needed). Multi-turn items are asked turn by turn with the target's own
    answer as the history. Prompts that are empty or do not fit the target's context
    (prompt + max_new_tokens + K + 1 > max_position_embeddings) are skipped and counted.
    settings: K (num_speculative_tokens), max_new_tokens, batch_size, temperature, seed, plot and the
    benchmark name (`EvalSettings.from_config` of the eval group; the caller checks every head's
    K_train with `EvalSettings.check_head`).
    precision: None decodes in the dtypes the target and heads have (the head's features are cast
    to its dtype); the command's ResolvedPrecision (or a setting auto | fp32 | bf16, resolved on the
    target's device) first puts both in that precision (`prepare_for_decoding`).
    Greedy with batch_size > 1 decodes each batch with shared forwards: speeds are then batch
    throughputs, and per-row seconds are shares of the batch's wall time (latency needs batch 1).
    Batches are formed from prompts of similar first-turn length (`_by_first_turn_length`); the
    results keep the prompts' order.

    Lossless (greedy): in fp32 the head's output must equal the target alone's exactly; below fp32
    at batch 1 it is compared with the target alone decoded in the verifier's numerics (decoder
    "reference": every token from a (K+1)-token forward, as the verifier computes it), and the
    turns that differ from the 1-token target alone are counted too
    (`mismatches_vs_one_token_target`); below fp32 in larger batches the check is not made
    (`lossless` None, `lossless_not_checked` gives the reason: the rounding depends on the batch's
    composition, which no target-alone pass shares) and the turns that differ from the target
    alone are only counted (`turns_differing_from_target_alone`).
    Speeds: before the first timed decode every decoder decodes the first prompt for up to
    WARMUP_TOKENS tokens, untimed (first-call costs: allocations, kernel selection); a speed-up is
    reported only over at least report.MIN_TIMED_TOKENS timed tokens per side (else `speedup` is
    None and `speedup_not_measured` says why).
    Writes out_dir/results.jsonl (+ results.meta.json) as it goes, then out_dir/acceptance.json
    (report.summarize: τ and its convention, per-position acceptance unconditional and
    conditional, lossless and its mismatch count, forward counts, speeds, time shares, latency,
    per category, skipped, optional baseline and calibration), per_prompt.csv and acceptance.png.
    Returns the acceptance dict.

    Raises BenchmarkError when no prompt could be decoded or two prompts share an id.
    """
    K, max_new_tokens, batch_size = settings.num_speculative_tokens, settings.max_new_tokens, settings.batch_size
    temperature, seed, benchmark = settings.temperature, settings.seed, settings.benchmark
    check_unique_ids(prompts, benchmark)
    greedy = temperature <= 0
    draft, baseline_draft, more_heads, prec_name = _in_precision(target, draft, baseline_draft, more_heads, precision)
    prompts = [q if "turns" in q or "messages" in q or "input_ids" in q else {**q, "turns": [q["prompt"]]}
               for q in prompts]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = eos_ids(target, tokenizer)
    ctx = getattr(target.config, "max_position_embeddings", None) or 10**9
    gen = torch.Generator(device=target.model.device).manual_seed(seed) if not greedy else None
    heads = [("head", draft, target)] + ([("baseline_head", baseline_draft, baseline_target or target)]
                                         if baseline_draft is not None else [])
    heads += [(f"{MORE_HEAD}{i}", d, t or target) for i, (_, d, t) in enumerate(more_heads, 1)]
    results = _open_results(out_dir, settings, prec_name, eos, heads)
    # greedy below fp32 at batch 1: the lossless reference is the target alone in the verifier's
    # numerics (verify-shaped (K+1)-token forwards); a 1-token forward rounds differently. In larger
    # batches the matmul shapes follow which rows are still decoding, so no reference can match them.
    reference = greedy and prec_name != "fp32" and batch_size == 1
    decoders = [("target", None, target)] + ([("reference", None, target)] if reference else []) + heads
    checked = prec_name == "fp32" or batch_size == 1  # report.py: below fp32 in batches no reference matches
    done_turns, skipped, decoded = _decode_turns(prompts, tokenizer, decoders, results, settings, eos=eos, ctx=ctx,
                                                 gen=gen, greedy=greedy, checked=checked)
    results.close()
    return _write_acceptance(done_turns, decoders, settings, out_dir, decoded=decoded, results=results,
                             skipped=skipped, num_prompts=len(prompts), precision=prec_name,
                             baseline_draft=baseline_draft, more_heads=more_heads, train_metrics=train_metrics)


def _in_precision(target, draft, baseline_draft, more_heads: list[tuple] | None,
                  precision: ResolvedPrecision | str | None) -> tuple:
    """The heads to decode with and the precision's name (evaluate_acceptance): with `precision`
    (a ResolvedPrecision, or auto | fp32 | bf16) the target is put in it in place and the heads are copies in it
    (`prepare_for_decoding`); with None all stay as they are and the name is the target's dtype
    (bf16, fp32, fp16, else str(dtype)). more_heads: [(name, head, target or None)].
    Returns (draft, baseline_draft or None, more_heads as a list, precision name)."""
    more_heads = list(more_heads or [])
    if precision is not None:
        resolved, (draft, baseline_draft, *more) = prepare_for_decoding(
            target, [draft, baseline_draft, *(d for _, d, _ in more_heads)], precision)
        more_heads = [(n, d, t) for (n, _, t), d in zip(more_heads, more)]
        prec_name = resolved.name
    else:
        prec_name = short_name(target.model.dtype)
    return draft, baseline_draft, more_heads, prec_name


def _open_results(out_dir: Path, settings: EvalSettings, prec_name: str, eos: set[int],
                  heads: list[tuple]) -> ResultLog:
    """out_dir/results.jsonl for these settings (results.meta.json: K, max_new_tokens, temperature,
    seed, batch_size, the precision's name, the eos ids and each head's `head_fingerprint`), with
    the results of an earlier run of the same settings read back (logged when there are some).
    heads: [(decoder name, head, target)]. Raises what `ResultLog` raises (CorruptFileError)."""
    meta = {"num_speculative_tokens": settings.num_speculative_tokens, "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature, "seed": settings.seed,
            "batch_size": settings.batch_size, "precision": prec_name, "eos": sorted(eos),
            "heads": {name: head_fingerprint(d) for name, d, _ in heads}, "timing": "warm-up excluded"}
    results = ResultLog(out_dir, meta)
    if results.reused:
        logger.info("resuming %s: %d results already decoded", results.path, results.reused)
    return results


def _n_turns(q: dict) -> int:
    """The number of turns of a prompt item: len(turns), else 1 ({messages} or {input_ids})."""
    return len(q.get("turns", [None]))


def _decode_turns(prompts: list[dict], tokenizer, decoders: list[tuple], results: ResultLog, settings: EvalSettings, *,
                  eos: set[int], ctx: int, gen, greedy: bool, checked: bool) -> tuple[list, dict, int]:
    """Decode every turn of `prompts` (normalised items, evaluate_acceptance) with every decoder
    [(name, head or None, target)], batch_size prompts at a time (by first-turn length when > 1),
    turn by turn, decoding only the (benchmark, id, turn, decoder) keys `results` does not hold yet
    and appending each result to it; before the first decode every decoder runs one untimed
    warm-up of up to WARMUP_TOKENS tokens. ctx: the target's context in tokens (10**9 if unknown);
    gen: the sampling generator (None when greedy).
    Returns (done turns [((prompt index, turn), per_prompt.csv row, {decoder: GenerationResult})]
    in decoding order, skipped counts {empty_prompt, too_long}, number of results decoded now)."""
    K, max_new_tokens, batch_size = settings.num_speculative_tokens, settings.max_new_tokens, settings.batch_size
    temperature, benchmark = settings.temperature, settings.benchmark
    decoded = 0
    done_turns, skipped = [], {"empty_prompt": 0, "too_long": 0}
    histories = [list(q.get("messages", [])[:-1]) for q in prompts]
    alive = [True] * len(prompts)
    bar = tqdm(total=sum(_n_turns(q) for q in prompts), desc=f"decoding (K={K})", unit="turn")
    warm = False
    batch_order = _by_first_turn_length(prompts, tokenizer) if batch_size > 1 else list(range(len(prompts)))
    for b0 in range(0, len(prompts), batch_size):
        idx = batch_order[b0:b0 + batch_size]
        for turn in range(1, max(_n_turns(prompts[i]) for i in idx) + 1):
            jobs, seen = _turn_jobs(prompts, idx, turn, tokenizer, histories, alive, skipped,
                                    room=max_new_tokens + K + 1, ctx=ctx)
            for name, d, t in decoders:  # decode what results.jsonl does not hold yet
                todo = [(i, ids) for i, ids in jobs if (benchmark, str(prompts[i]["id"]), turn, name) not in results.done]
                if not todo:
                    continue
                if not warm:  # first-call costs out of the timed decodes: every decoder, untimed, once
                    for wname, wd, wt in decoders:
                        generate(wt, wd, [todo[0][1]], K, min(max_new_tokens, WARMUP_TOKENS), eos,
                                 verifier_numerics=wname == "reference")
                    warm = True
                out = generate(t, d, [ids for _, ids in todo], K, max_new_tokens, eos, temperature=temperature,
                               generator=gen, verifier_numerics=name == "reference")
                for (i, ids), r in zip(todo, out):
                    results.add(_record(benchmark, prompts[i], turn, name, len(ids), r))
                decoded += len(todo)
            for i, ids in jobs:
                q = prompts[i]
                res = {name: _result(results.done[(benchmark, str(q["id"]), turn, name)]) for name, _, _ in decoders}
                if "input_ids" not in q:
                    histories[i].append({"role": "assistant",
                                         "content": tokenizer.decode(res["target"].tokens, skip_special_tokens=True)})
                done_turns.append(((i, turn), _row(q, turn, len(ids), res, greedy, checked), res))
            bar.update(seen)
    bar.close()
    return done_turns, skipped, decoded


def _turn_jobs(prompts: list[dict], idx: list[int], turn: int, tokenizer, histories: list[list], alive: list[bool],
               skipped: dict[str, int], *, room: int, ctx: int) -> tuple[list[tuple[int, list[int]]], int]:
    """The prompts of batch `idx` to decode at `turn` (1-based), each with its token ids: the user's
    message is appended to its history and the chat tokenised ({input_ids} items as given). A prompt
    that is empty, or whose ids + `room` (max_new_tokens + K + 1 tokens) exceed `ctx`, is counted in
    `skipped` (empty_prompt, too_long) and marked not `alive`, and so are its later turns (no
    history). Returns ([(prompt index, ids)], number of the batch's prompts that have this turn)."""
    jobs, seen = [], 0
    for i in idx:
        q = prompts[i]
        if turn > _n_turns(q):
            continue
        seen += 1
        if not alive[i]:  # an earlier turn was skipped: the later ones have no history
            continue
        if "input_ids" in q:
            ids = list(q["input_ids"])
        else:
            user = _user_text(q, turn)
            if not str(user).strip():
                skipped["empty_prompt"] += 1; alive[i] = False
                continue
            histories[i].append({"role": "user", "content": user})
            ids = chat_ids(tokenizer, histories[i])
        if not ids:
            skipped["empty_prompt"] += 1; alive[i] = False
            continue
        if len(ids) + room > ctx:
            skipped["too_long"] += 1; alive[i] = False
            continue
        jobs.append((i, ids))
    return jobs, seen


def _write_acceptance(done_turns: list, decoders: list[tuple], settings: EvalSettings, out_dir: Path, *, decoded: int,
                      results: ResultLog, skipped: dict[str, int], num_prompts: int, precision: str, baseline_draft,
                      more_heads: list[tuple], train_metrics: dict | None) -> dict:
    """The acceptance dict of the decoded turns (report.summarize, in the prompts' order, with
    "benchmark": settings.benchmark, the name the export's model card lists it under), written
    to out_dir (report.write_report: per_prompt.csv, acceptance.png when settings.plot,
    acceptance.json) and logged. done_turns: `_decode_turns`'s; precision: its name (fp32, bf16, ...).
    Raises BenchmarkError when no turn was decoded (every prompt skipped)."""
    done_turns.sort(key=lambda t: t[0])  # the prompts' own order, whatever the batches were
    rows, order = [r for _, r, _ in done_turns], [res for _, _, res in done_turns]
    logger.info("decoded %d results, reused %d from %s", decoded, results.reused, results.path)
    if not rows:
        raise BenchmarkError(f"no prompt could be decoded: skipped {skipped} of {num_prompts}. Fix: shorter prompts or "
                             "a smaller eval.max_new_tokens.")
    res_all = {name: [r[name] for r in order] for name, _, _ in decoders}
    result = summarize(rows, res_all, K=settings.num_speculative_tokens, max_new_tokens=settings.max_new_tokens,
                       temperature=settings.temperature, batch_size=settings.batch_size, precision=precision,
                       skipped=skipped,
                       baseline_algorithm=baseline_draft.config.algorithm if baseline_draft is not None else None,
                       train_metrics=train_metrics,
                       more_heads=[(n, d.config.algorithm) for n, d, _ in more_heads])
    result["benchmark"] = settings.benchmark
    write_report(result, rows, out_dir, settings.plot)
    logger.info(format_acceptance(result))
    return result


def eos_ids(target, tokenizer) -> set[int]:
    """The token ids that end a generation: the target's generation_config eos ids and the
    tokenizer's eos token."""
    eos = set(_as_list(getattr(target.model.generation_config, "eos_token_id", None)))
    if tokenizer is not None:
        eos.add(tokenizer.eos_token_id)
    eos.discard(None)
    return eos


def _user_text(q: dict, turn: int):
    """The user's message of turn `turn` (1-based) of a {turns} or {messages} item."""
    return q["turns"][turn - 1] if "turns" in q else q["messages"][-1]["content"]


def _by_first_turn_length(prompts: list[dict], tokenizer) -> list[int]:
    """Prompt indices sorted by the token count of their first turn (stable), so that a batch
    holds prompts of similar length: every row of a batch attends over the slots of its longest
    prompt, and MT-Bench's first turns range from 42 to 402 SmolLM2 tokens (a batch of 16 in
    benchmark order pads to the longest). Items without a tokenizer or text count as 0."""
    def length(q: dict) -> int:
        if "input_ids" in q:
            return len(q["input_ids"])
        if not q.get("turns", True) or not q.get("messages", True):
            return 0  # nothing to decode (the loop skips it)
        user = _user_text(q, 1)
        if tokenizer is None or not str(user).strip():
            return 0
        return len(chat_ids(tokenizer, list(q.get("messages", [])[:-1]) + [{"role": "user", "content": user}]))

    lengths = [length(q) for q in prompts]
    return sorted(range(len(prompts)), key=lengths.__getitem__)


def _as_list(x):
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])
