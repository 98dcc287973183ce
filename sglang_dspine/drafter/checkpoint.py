"""Drafter checkpoints: load the three layouts users bring, save the SpecForge one.

- SpecForge layout: `config.json` + `model.safetensors` (or shards with `model.safetensors.index.json`)
  holding every tensor, the transfer codes (`transfer_codes`) and `transfer_ready` included.
- Reference-release layout: the same, but the codes live in `transfer.safetensors` as `codes`.
- DFlash checkpoint (architecture DFlashDraftModel): loaded as itself, or as a DSpine warm start whose
  injection weights are zero (so it computes exactly what the DFlash drafter computes) and whose transfer
  space is computed from the target's LM head.

Loading is strict: a missing, unexpected or mis-shaped tensor, or unusable codes, raise
`DrafterConfigError` naming the tensor and what was expected.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import DSPINE_ARCH, DrafterConfig, DrafterConfigError, DSpineSettings, read_json
from .model import DSpineDrafter
from .transfer import check_codes, compute_transfer_space

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TRANSFER_FILE = "transfer.safetensors"
RELEASE_CODES = "codes"  # the codes' tensor name in TRANSFER_FILE (the reference release's layout)
CODES_KEY = "transfer_codes"
READY_KEY = "transfer_ready"


def model_files(path: str) -> list[str]:
    """The weight files of a checkpoint directory: `model.safetensors`, or the shards its index's `weight_map`
    names. A missing file or an index without a usable `weight_map` raises `DrafterConfigError` naming it."""
    if not path or not os.path.isdir(path):
        raise DrafterConfigError(f"checkpoint {path!r}: not a directory")
    single, index = os.path.join(path, MODEL_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise DrafterConfigError(f"{index}: expected a `weight_map` object (tensor name -> shard file), "
                                     f"found {weight_map!r}")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [f for f in shards if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise DrafterConfigError(f"{index}: weight_map names shard files that are not in {path}: {missing[:4]}")
        return [os.path.join(path, f) for f in shards]
    raise DrafterConfigError(f"checkpoint {path}: neither {MODEL_FILE} nor {INDEX_FILE} found")


def _unreadable(file: str, e: Exception) -> DrafterConfigError:
    return DrafterConfigError(f"{file}: not a readable safetensors file ({e}); truncated or still being copied?")


def load_safetensors(file: str) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a truncated or foreign file raises `DrafterConfigError` naming it."""
    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None


def safetensors_shapes(file: str) -> dict[str, list[int]]:
    """Names and shapes of one safetensors file's tensors, from its header (no tensor is read). The header
    check covers the whole file: a truncated file is refused here, naming it."""
    try:
        with safe_open(file, framework="pt") as st:
            return {k: st.get_slice(k).get_shape() for k in st.keys()}
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e) from None


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory's model files (single file or shards)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in model_files(path):
        tensors.update(load_safetensors(file))
    return tensors


def tensor_shapes(path: str) -> dict[str, list[int]]:
    """Names and shapes of the model files' tensors, from their headers (no tensor is read)."""
    shapes: dict[str, list[int]] = {}
    for file in model_files(path):
        shapes.update(safetensors_shapes(file))
    return _strip_prefix(shapes)


def _strip_prefix(tensors: dict) -> dict:
    # Some exports nest the drafter under `model.`; only strip when every name carries it.
    if tensors and all(k.startswith("model.") for k in tensors):
        return {k[len("model."):]: v for k, v in tensors.items()}
    return tensors


def load_state_strict(
    model: DSpineDrafter, tensors: dict[str, torch.Tensor], source: str, names: set[str] | None = None
) -> None:
    """Copy `tensors` into `model`, refusing missing, unexpected or mis-shaped names.

    names: the subset of the model's tensors the checkpoint must hold exactly (default: all of them).
    """
    state = model.state_dict()
    expected = {k: v for k, v in state.items() if names is None or k in names}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise DrafterConfigError(f"checkpoint {source}: missing tensors "
                                 f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        raise DrafterConfigError(
            f"checkpoint {source}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"(not part of a {model.cfg.kind} drafter with this config)"
        )
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise DrafterConfigError(
                f"checkpoint {source}: tensor `{name}` expected shape {tuple(ref.shape)}, "
                f"found {tuple(tensors[name].shape)}"
            )
    model.load_state_dict({k: tensors[k].to(ref.dtype) for k, ref in expected.items()}, strict=names is None)


def check_dspine_transfer(model: DSpineDrafter, source: str) -> None:
    cfg = model.cfg
    check_codes(model.transfer_codes, cfg.vocab_size, cfg.dspine.transfer_rank)
    if not bool(model.transfer_ready):
        raise DrafterConfigError(f"checkpoint {source}: `transfer_ready` is false; the transfer codes were never set")


def raw_config(path: str) -> tuple[dict, bool, bool]:
    """config.json as stored (unwrapped where the release wraps it in {"config": ...}), whether it was wrapped,
    and whether the release's own rules apply: no `dspine_config`, codes in transfer.safetensors."""
    if not path or not os.path.isdir(path):
        raise DrafterConfigError(f"drafter {path!r}: not a directory")
    raw = read_json(os.path.join(path, "config.json"))
    wrapped = set(raw) == {"config"}
    if wrapped:
        raw = raw["config"]
        if not isinstance(raw, dict):
            raise DrafterConfigError(f"{os.path.join(path, 'config.json')}: `config` is not a JSON object")
    return raw, wrapped, "dspine_config" not in raw and os.path.isfile(os.path.join(path, TRANSFER_FILE))


def is_unconverted_release(path: str) -> bool:
    """A reference-release folder whose config.json is the release's own (wrapped, or without `dspine_config`):
    `load_drafter` reads it by the release's rules, but SGLang builds a model from config.json as written."""
    _, wrapped, release_rules = raw_config(path)
    return wrapped or release_rules


def _read_config(path: str) -> DrafterConfig:
    """The drafter config; a reference-release directory (codes in transfer.safetensors, a config without
    `dspine_config`) is read by the release's own rules (its converter's): DSpine architecture, block size
    16, full attention, top_k 16, rank and message size taken from the tensors."""
    raw, _, release_rules = raw_config(path)
    if release_rules:
        shapes = tensor_shapes(path)
        for name in ("injection.readouts.0.weight", "injection.message.weight"):
            if name not in shapes:
                raise DrafterConfigError(f"reference-release checkpoint {path}: missing tensor `{name}`")
        n_layers = int(raw.get("num_hidden_layers", 0))
        raw = {**raw, "architectures": [DSPINE_ARCH], "block_size": 16, "is_causal": True,
               "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * n_layers}
        raw.pop("auto_map", None)
        raw["dflash_config"] = {**raw.get("dflash_config", {}), "block_size": 16}
        raw["dspine_config"] = {
            "transfer_rank": int(shapes["injection.readouts.0.weight"][0]),
            "message_size": int(shapes["injection.message.weight"][0]),
            "top_k": 16,
        }
    try:
        return DrafterConfig.from_dict(raw)
    except DrafterConfigError as e:  # its messages name the field; this names the folder
        raise DrafterConfigError(f"drafter {path}: {e}") from None


def check_drafter_dir(path: str) -> DrafterConfig:
    """What can be checked of a drafter folder without reading its tensors: its config, and that every weight
    file (and a release's transfer.safetensors) is a complete safetensors file. Returns the config."""
    cfg = _read_config(path)
    tensor_shapes(path)
    side = os.path.join(path, TRANSFER_FILE)
    if os.path.isfile(side):
        safetensors_shapes(side)
    return cfg


def load_drafter(
    path: str,
    *,
    as_dspine: bool = False,
    target_head: torch.Tensor | None = None,
    dspine_settings: DSpineSettings | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DSpineDrafter:
    """Load a drafter from `path`.

    as_dspine: a DFlash checkpoint becomes a DSpine warm start (needs `target_head` [V, H] for the codes).
    target_head, when given, is also checked against the drafter's vocabulary and width.
    """
    cfg = _read_config(path)
    if target_head is not None:
        cfg.check_target(target_hidden_size=target_head.shape[1], target_vocab_size=target_head.shape[0])
    tensors = _strip_prefix(read_tensors(path))
    width = tensors.get("fc.weight")
    if width is not None and width.shape[1] != len(cfg.target_layer_ids) * cfg.hidden_size:
        raise DrafterConfigError(
            f"checkpoint {path}: `fc.weight` width expected {len(cfg.target_layer_ids) * cfg.hidden_size} "
            f"(len(target_layer_ids)={len(cfg.target_layer_ids)} × hidden_size={cfg.hidden_size}), "
            f"found {width.shape[1]}"
        )

    if cfg.kind == "dflash" and as_dspine:
        return warm_start_from_dflash(cfg, tensors, target_head, dspine_settings, path).to(device=device, dtype=dtype)

    if cfg.is_dspine:
        resolve_transfer_codes(tensors, path, cfg)
    model = DSpineDrafter(cfg)
    load_state_strict(model, tensors, path)
    if cfg.is_dspine:
        check_dspine_transfer(model, path)
    return model.to(device=device, dtype=dtype)


def warm_start_from_dflash(
    cfg: DrafterConfig,
    tensors: dict[str, torch.Tensor],
    target_head: torch.Tensor | None,
    settings: DSpineSettings | None,
    source: str,
) -> DSpineDrafter:
    """A DSpine drafter on a trained DFlash backbone: zero writes, codes and readouts from the head.

    The DFlash backbone was trained bidirectional inside the block; the DSpine drafter is causal, which is
    the one behavioural change (docs/algorithm.md) and what the DSpine fine-tune adapts to.
    """
    if target_head is None:
        raise DrafterConfigError("warm start from a DFlash checkpoint needs the target's LM head "
                                 "for the transfer codes")
    dcfg = cfg.as_dspine(settings)
    model = DSpineDrafter(dcfg)
    backbone = {k for k in model.state_dict() if not k.startswith("injection.") and k not in (CODES_KEY, READY_KEY)}
    load_state_strict(model, tensors, source, names=backbone)
    init_dspine_transfer(model, target_head)
    return model


def init_dspine_transfer(model: DSpineDrafter, target_head: torch.Tensor) -> None:
    """Compute the transfer space of a fresh DSpine drafter from the target head; R_l = Dᵀ."""
    space = compute_transfer_space(target_head, model.cfg.dspine.transfer_rank)
    with torch.no_grad():
        model.transfer_codes.copy_(space.codes.to(model.transfer_codes.dtype))
        model.transfer_ready.fill_(True)
        model.injection.init_readouts(space.directions)


# A DSpine drafter's transfer codes live in one of two places: `transfer_codes` in its model files (SpecForge
# layout, beside `transfer_ready`), or `codes` in the folder's TRANSFER_FILE (the reference release's layout,
# without `transfer_ready`: codes there were computed). These two functions are the only ones that know it.
def has_transfer_codes(path: str) -> bool:
    """Whether the drafter folder `path` holds transfer codes in either place, from file headers only."""
    if CODES_KEY in tensor_shapes(path):
        return True
    side = os.path.join(path, TRANSFER_FILE)
    return os.path.isfile(side) and RELEASE_CODES in safetensors_shapes(side)


def resolve_transfer_codes(tensors: dict[str, torch.Tensor], path: str, cfg: DrafterConfig) -> None:
    """Complete `tensors` (a DSpine drafter's, by state-dict name) in place with the transfer codes of the
    drafter folder `path`, and refuse a drafter without them. `tensors` may already hold TRANSFER_FILE's
    `codes` (a loader that reads every file of the folder, as SGLang's does)."""
    if CODES_KEY not in tensors:
        codes = tensors.pop(RELEASE_CODES, None)
        if codes is None:
            side = os.path.join(path, TRANSFER_FILE)
            if os.path.isfile(side):
                found = load_safetensors(side)
                if RELEASE_CODES not in found:
                    raise DrafterConfigError(f"checkpoint {side}: expected tensor `{RELEASE_CODES}`, "
                                             f"found {sorted(found)}")
                codes = found[RELEASE_CODES]
        if codes is not None:
            tensors[CODES_KEY] = codes
            tensors.setdefault(READY_KEY, torch.tensor(True))
    if CODES_KEY not in tensors:
        check_codes(None, cfg.vocab_size, cfg.dspine.transfer_rank)
    if READY_KEY not in tensors:
        raise DrafterConfigError(f"checkpoint {path}: missing tensor `{READY_KEY}`")


def save_drafter(model: DSpineDrafter, path: str, layout: str = "specforge") -> None:
    """Write `config.json` + `model.safetensors` (SpecForge layout). `layout="release"` moves the codes to
    `transfer.safetensors` (`codes`), as the reference release does."""
    if layout not in ("specforge", "release"):
        raise ValueError(f"layout: expected 'specforge' or 'release', found {layout!r}")
    os.makedirs(path, exist_ok=True)
    config = model.cfg.to_dict()
    # The weights' dtype, under both names transformers has used: servers pick the draft dtype from it.
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config["dtype"] = config["torch_dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if layout == "release" and CODES_KEY in state:
        save_file({RELEASE_CODES: state.pop(CODES_KEY).float()}, os.path.join(path, TRANSFER_FILE))
        state.pop(READY_KEY, None)
    save_file(state, os.path.join(path, MODEL_FILE))
