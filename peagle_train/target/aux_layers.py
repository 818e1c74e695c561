"""The target layers a head reads: `AuxLayers`, the one owner of every rule on aux layer ids.

What an id means (DESIGN.md §2): id k is HF `output_hidden_states[k]`, the input of decoder layer k,
as vLLM (`models/llama.py` collects it at the top of its layer loop), speculators and EAGLE-3 read
it (`AUX_LAYER_NUMBERING`). Checkpoints and exports record it under `aux_layer_numbering`; files
without it were written with the older numbering "layer_output" (id i = the output of layer i =
`output_hidden_states[i+1]`), read converted (`AuxLayers.read`).

The rules: P-EAGLE and EAGLE-3 heads read 3 layers, DFlash 1 or more (draft/head_config.py `aux_count`); the ids
are distinct, ascending and in [0, N) for an N-layer target (`AuxLayers.problem`); none given means
[2, N//2, N-3] for P-EAGLE and EAGLE-3, and for DFlash the paper's 5 layers spread from the 2nd to the
third-to-last (`AuxLayers.default`, `AuxLayers.spread`).
"""

from __future__ import annotations

from dataclasses import dataclass

AUX_LAYER_NUMBERING = "hidden_states"
OLD_AUX_LAYER_NUMBERING = "layer_output"
DFLASH_AUX_COUNT = 5  # DFlash (arXiv 2602.06036 §A.1) reads 5 target layers


@dataclass(frozen=True)
class AuxLayers:
    """Aux layer ids in `AUX_LAYER_NUMBERING`, checked: ids (k0, k1, ..) ascending, distinct."""

    ids: tuple[int, ...]

    def to_json(self) -> list[int]:
        """The ids as written in configs, checkpoints and exports: a list of ints."""
        return list(self.ids)

    @staticmethod
    def default(num_layers: int, count: int | None = 3) -> list[int]:
        """The ids a head reads when none are given, for a target with N decoder layers: for 3 ids
        (P-EAGLE, EAGLE-3) [2, N//2, N-3] (EAGLE-3 / vLLM default, in `AUX_LAYER_NUMBERING`; distinct
        for N ≥ 8); for any number (count None: DFlash) `spread(N, DFLASH_AUX_COUNT)`."""
        if count is None:
            return AuxLayers.spread(num_layers, DFLASH_AUX_COUNT)
        return [2, num_layers // 2, num_layers - 3]

    @staticmethod
    def spread(num_layers: int, n: int) -> list[int]:
        """DFlash's placement of n target layers (arXiv 2602.06036 §A.1: uniform from the second
        layer to the third-to-last; z-lab/dflash `build_target_layer_ids`): the outputs of decoder
        layers round(1 + i·(N-4)/(n-1)), i = 0..n-1 (Python's round), the middle layer N//2 for
        n = 1; in `AUX_LAYER_NUMBERING` (the output of layer i is id i + 1), ascending. A target too
        shallow for n distinct layers (N < n + 3) gets the distinct ones only. E.g. N = 30, n = 5:
        [2, 9, 15, 21, 28]."""
        if n == 1:
            return [num_layers // 2 + 1]
        start, end = 1, max(num_layers - 3, 1)
        return sorted({round(start + i * (end - start) / (n - 1)) + 1 for i in range(n)})

    @classmethod
    def resolve(cls, ids: list | None, num_layers: int, setting: str = "target.aux_layer_ids",
                count: int | None = 3) -> "AuxLayers":
        """The ids a run uses for a target of N = `num_layers` layers: `ids`, or the default when none
        are given. Raises ConfigError (one line naming `setting`, with the fix) unless they pass
        `problem`."""
        from ..errors import ConfigError

        ids = [int(i) for i in ids] if ids else cls.default(num_layers, count)
        problem = cls.problem(ids, num_layers, setting, count)
        if problem:
            raise ConfigError(problem)
        return cls(tuple(ids))

    @staticmethod
    def read(ids: list, numbering: str) -> list[int]:
        """Ids read from a file that says they are in `numbering`, in `AUX_LAYER_NUMBERING`: the old
        "layer_output" numbering (id i = output of layer i) gives each id + 1, the very same hidden
        states; vLLM's is returned as it is. Raises ValueError for another numbering."""
        if numbering == OLD_AUX_LAYER_NUMBERING:
            return [int(i) + 1 for i in ids]
        if numbering != AUX_LAYER_NUMBERING:
            raise ValueError(f"aux_layer_numbering={numbering!r} must be {AUX_LAYER_NUMBERING!r} "
                             f"or {OLD_AUX_LAYER_NUMBERING!r}")
        return list(ids)

    @staticmethod
    def problem(ids: list, num_layers: int | None, setting: str = "target.aux_layer_ids",
                count: int | None = 3) -> str | None:
        """None when `ids` are `count` (None: one or more) distinct, ascending layer ids in [0, N) for a
        target of N = `num_layers` decoder layers (num_layers None: when the target is not loaded yet,
        ids ≥ 0), in `AUX_LAYER_NUMBERING` (0 = the embeddings); else one sentence naming `setting`, the
        ids and the fix.

        Why these rules: vLLM's EAGLE-3 path concatenates 3 features (3H) in ascending id order (DFlash
        any number, `count`); speculators rejects repeated layers; id N (vLLM: the last layer's output
        before the final norm) is left out, since HF's hidden_states[N] is after the norm and the two
        readings of the numbering differ there."""
        many = f"{count}" if count else "1 or more"
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return (f"{setting}={ids} must be a list of {many} layer ids (integers). Fix: {setting}=null for the default "
                    "[2, N//2, N-3] of an N-layer target, or e.g. [2, 6, 9].")
        ids = [int(i) for i in ids]
        n_ok = len(ids) == count if count else len(ids) >= 1
        ok = n_ok and len(set(ids)) == len(ids) and all(0 <= i and (num_layers is None or i < num_layers) for i in ids)
        if not ok:
            if num_layers is None:
                return (f"{setting}={ids} must be {many} distinct layer ids ≥ 0, ascending (id k = the hidden state "
                        "entering decoder layer k, HF hidden_states[k], as vLLM reads it; below the target's layer count). "
                        f"Fix: {setting}=null for the default [2, N//2, N-3] of an N-layer target, or {many} such ids.")
            default, spread = AuxLayers.default(num_layers, count), [0, num_layers // 2, num_layers - 1]
            if len(set(default)) == len(default) and min(default) >= 0 and (count is None or len(default) == count):
                fix = f"{setting}=null for the default {default}, or {many} ids in that range."
            elif len(set(spread)) == 3:  # a shallow target, where [2, N//2, N-3] repeats a layer
                fix = f"{setting}={spread}, or {many} other distinct ids in that range."
            else:
                fix = "a target with at least 3 decoder layers (the head reads 3 of its hidden states)."
            return (f"{setting}={ids} must be {many} distinct layer ids in [0, {num_layers}) for this {num_layers}-layer "
                    "target (id k = the hidden state entering decoder layer k, HF hidden_states[k], as vLLM reads it). "
                    f"Fix: {fix}")
        if ids != sorted(ids):
            return (f"{setting}={ids} is not in ascending order; vLLM sorts the ids and would feed the features in "
                    f"another order than training. Fix: {setting}={sorted(ids)}.")
        return None

    @staticmethod
    def ascending_problem(ids: list, what: str) -> str | None:
        """None when `ids` are in ascending order; else one sentence naming `what` (the setting or the
        file's key): vLLM sorts the ids, so the features would arrive in another order."""
        if list(ids) == sorted(ids):
            return None
        return f"{what} {list(ids)} are not ascending (vLLM sorts them)"
