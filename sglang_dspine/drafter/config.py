"""Drafter configuration: parse and validate the `config.json` of a DSpine or DFlash drafter.

The format is a Qwen3 config plus the DFlash fields (`block_size`, `num_target_layers`,
`dflash_config {mask_token_id, target_layer_ids}`) and, for DSpine, `dspine_config` (docs/algorithm.md).
Every inconsistency raises `DrafterConfigError` naming the field, what was expected and what was found.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

DSPINE_ARCH = "DSpineDraftModel"
DFLASH_ARCH = "DFlashDraftModel"


class DrafterConfigError(ValueError):
    """A drafter config or checkpoint that cannot be used as it is."""


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; a missing, unreadable or malformed file raises `DrafterConfigError` naming it."""
    if not os.path.isfile(path):
        raise DrafterConfigError(f"{path}: not found")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise DrafterConfigError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DrafterConfigError(f"{path}: cannot be read ({e})") from None
    if not isinstance(obj, dict):
        raise DrafterConfigError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    return obj


@dataclass
class DSpineSettings:
    """`dspine_config`: the DSpine-only hyper-parameters (architecture and training objective)."""

    # Defaults are the reference's (SpecForge `DSpineConfig`).
    transfer_rank: int = 1024
    message_size: int = 512
    top_k: int = 16
    ce_weight: float = 0.1
    alignment_weight: float = 0.5
    alignment_warmup_steps: int = 146
    replacement_layers: int = 3
    replacement_probability: float = 0.5
    replacement_hold_ratio: float = 1 / 6
    replacement_end_ratio: float = 1 / 3
    candidate_mass_threshold: float = 1e-4

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSpineSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DrafterConfigError(f"config.json dspine_config: unknown fields {unknown}")
        # The weights' shapes follow these two: a default filled in would be refused later as a value "found"
        # that is in no file (the other settings have the reference's defaults).
        for name in ("transfer_rank", "message_size"):
            if d.get(name) is None:
                raise DrafterConfigError(f"config.json: missing required field `dspine_config.{name}`")
        out = cls(**d)
        out.validate()
        return out

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int)):
                raise DrafterConfigError(f"config.json dspine_config.{f.name}: expected an integer, found {v!r}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise DrafterConfigError(f"config.json dspine_config.{f.name}: expected a finite number, found {v!r}")
        checks = [
            ("message_size", self.message_size >= 1, ">= 1"),
            ("ce_weight", 0 <= self.ce_weight <= 1, "in [0, 1]"),
            ("alignment_weight", self.alignment_weight >= 0, ">= 0"),
            ("alignment_warmup_steps", self.alignment_warmup_steps >= 0, ">= 0"),
            ("replacement_layers", self.replacement_layers >= 0, ">= 0"),
            ("replacement_probability", 0 <= self.replacement_probability <= 1, "in [0, 1]"),
            ("replacement_hold_ratio", 0 <= self.replacement_hold_ratio < self.replacement_end_ratio <= 1,
             "with 0 <= replacement_hold_ratio < replacement_end_ratio <= 1"),
            ("candidate_mass_threshold", 0 <= self.candidate_mass_threshold < 1, "in [0, 1)"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise DrafterConfigError(f"config.json dspine_config.{name}: expected {want}, "
                                         f"found {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def scaled_for(cls, hidden_size: int, vocab_size: int, **overrides: Any) -> DSpineSettings:
        """Defaults scaled to a backbone: the reference's r = H/4 (1024 at H = 4096) and m = r/2, capped there."""
        rank = min(1024, max(1, hidden_size // 4), vocab_size - 1)
        return cls(**{"transfer_rank": rank, "message_size": max(1, min(512, rank // 2)), **overrides})


@dataclass
class DrafterConfig:
    """The fields the drafter needs, validated. `raw` keeps the whole json so saving loses nothing."""

    kind: str  # "dspine" or "dflash"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    is_causal: bool
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    attention_bias: bool = False
    dspine: DSpineSettings | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def is_dspine(self) -> bool:
        return self.kind == "dspine"

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        d = copy.deepcopy(d)
        archs = d.get("architectures") or []
        if archs == [DSPINE_ARCH] or (DSPINE_ARCH in archs):
            kind = "dspine"
        elif DFLASH_ARCH in archs:
            kind = "dflash"
        else:
            raise DrafterConfigError(
                f"config.json architectures: expected [{DSPINE_ARCH!r}] or [{DFLASH_ARCH!r}], found {archs!r}"
            )
        if kind == "dspine" and "dspine_config" not in d:
            raise DrafterConfigError("config.json: architecture DSpineDraftModel but no `dspine_config` field")

        def need(key: str, where: dict[str, Any] = d, prefix: str = "") -> Any:
            if key not in where or where[key] is None:
                raise DrafterConfigError(f"config.json: missing required field `{prefix}{key}`")
            return where[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = int(d.get("head_dim") or hidden // heads)
        rope_theta = _rope_theta(d)
        dflash = need("dflash_config")
        _refuse_unsupported(d, dflash)
        # z-lab reads knobs from dflash_config first, then the top level; both present must agree.
        if "block_size" in dflash and "block_size" in d and int(dflash["block_size"]) != int(d["block_size"]):
            raise DrafterConfigError(
                f"config.json block_size: top level {d['block_size']} and dflash_config.block_size "
                f"{dflash['block_size']} disagree"
            )
        block_size = int(dflash.get("block_size", need("block_size")))
        mask_token_id = int(need("mask_token_id", dflash, "dflash_config."))
        if dflash.get("target_layer_ids") is not None:
            target_layer_ids = [int(x) for x in dflash["target_layer_ids"]]
        else:  # DFlash's documented default when the field is absent
            n_target, n_layers = int(need("num_target_layers")), int(need("num_hidden_layers"))
            try:
                target_layer_ids = default_target_layer_ids(n_target, n_layers)
            except DrafterConfigError:
                raise DrafterConfigError(
                    f"config.json: missing field `dflash_config.target_layer_ids`, and DFlash's default for it "
                    f"(spread over layers 1 to num_target_layers - 3) does not fit {n_layers} drafter layers on "
                    f"{n_target} target layers; write the ids the drafter was trained with") from None
        # DSpine is causal inside the block; DFlash checkpoints are bidirectional (docs/algorithm.md).
        is_causal = bool(d.get("is_causal", kind == "dspine"))
        cfg = cls(
            kind=kind,
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            block_size=block_size,
            is_causal=is_causal,
            num_target_layers=int(need("num_target_layers")),
            mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids,
            attention_bias=bool(d.get("attention_bias", False)),
            dspine=DSpineSettings.from_dict(d["dspine_config"]) if kind == "dspine" else None,
            raw=d,
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str) -> DrafterConfig:
        """The config of a drafter folder (or its config.json); an error names the folder."""
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        raw = read_json(os.path.join(path, "config.json") if os.path.isdir(path) else path)
        try:
            return cls.from_dict(raw)
        except DrafterConfigError as e:
            raise DrafterConfigError(f"drafter {folder}: {e}") from None

    # ------------------------------------------------------------- validation
    def validate(self) -> None:
        if self.block_size < 2:
            raise DrafterConfigError(f"config.json block_size: expected >= 2, found {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterConfigError(
                f"config.json dflash_config.mask_token_id: expected in [0, {self.vocab_size}), "
                f"found {self.mask_token_id}"
            )
        if not self.target_layer_ids:
            raise DrafterConfigError("config.json dflash_config.target_layer_ids: expected a non-empty list")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise DrafterConfigError(
                f"config.json dflash_config.target_layer_ids: expected ids in [0, {self.num_target_layers}) "
                f"(num_target_layers), found {bad}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"config.json num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dspine is not None:
            s = self.dspine
            if not 1 <= s.top_k <= self.vocab_size:
                raise DrafterConfigError(
                    f"config.json dspine_config.top_k: expected in [1, {self.vocab_size}], found {s.top_k}"
                )
            limit = min(self.hidden_size, self.vocab_size - 1)
            if not 1 <= s.transfer_rank <= limit:
                raise DrafterConfigError(
                    f"config.json dspine_config.transfer_rank: expected in [1, {limit}] "
                    f"(min(hidden_size, vocab_size - 1)), found {s.transfer_rank}"
                )
            if not self.is_causal:
                raise DrafterConfigError("config.json is_causal: DSpine drafters are causal inside the block, "
                                         "found false")

    def check_target(self, target_hidden_size: int, target_vocab_size: int,
                     target_num_layers: int | None = None) -> None:
        """Refuse a drafter that does not fit the target it is paired with."""
        if self.hidden_size != target_hidden_size:
            raise DrafterConfigError(
                f"drafter hidden_size: expected {target_hidden_size} (the target's), found {self.hidden_size}"
            )
        if self.vocab_size != target_vocab_size:
            raise DrafterConfigError(
                f"drafter vocab_size: expected {target_vocab_size} (the target's), found {self.vocab_size}"
            )
        if target_num_layers is not None and self.num_target_layers != target_num_layers:
            raise DrafterConfigError(
                f"drafter num_target_layers: expected {target_num_layers} (the target's num_hidden_layers), "
                f"found {self.num_target_layers}"
            )

    # ----------------------------------------------------------------- saving
    def to_dict(self) -> dict[str, Any]:
        d = copy.deepcopy(self.raw)
        d.update(
            architectures=[DSPINE_ARCH if self.is_dspine else DFLASH_ARCH],
            model_type=d.get("model_type", "qwen3"),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            block_size=self.block_size,
            is_causal=self.is_causal,
            num_target_layers=self.num_target_layers,
            attention_bias=self.attention_bias,
            layer_types=["full_attention"] * self.num_hidden_layers,
        )
        d.setdefault("hidden_act", "silu")
        d["dflash_config"] = {
            **d.get("dflash_config", {}),
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        if self.dspine is not None:
            d["dspine_config"] = self.dspine.to_dict()
        else:
            d.pop("dspine_config", None)
        return d

    def as_dspine(self, settings: DSpineSettings | None = None) -> DrafterConfig:
        """The DSpine config of the same backbone (a DFlash drafter as a DSpine warm start)."""
        d = self.to_dict()
        d["architectures"] = [DSPINE_ARCH]
        d["is_causal"] = True
        d["dspine_config"] = (settings or self.dspine or DSpineSettings.scaled_for(self.hidden_size,
                                                                                   self.vocab_size)).to_dict()
        return DrafterConfig.from_dict(d)


def _refuse_unsupported(d: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Variants of the DFlash format that this drafter does not implement are refused, never ignored."""
    types = d.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise DrafterConfigError(f"config.json layer_types: only full_attention layers are supported, found {types}")
    if d.get("use_sliding_window"):
        raise DrafterConfigError("config.json use_sliding_window: sliding-window drafters are not supported, "
                                 "found true")
    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        value = dflash.get(key, d.get(key, neutral))
        if (value != 1.0) if neutral == 1.0 else (value not in (None, 0, 0.0)):  # a softcap of 0 means none
            raise DrafterConfigError(f"config.json {key}: only {neutral!r} is supported, found {value!r}")
    mode = dflash.get("attention_mode", d.get("attention_mode", "gqa"))
    if mode not in ("gqa", "mha"):
        raise DrafterConfigError(f"config.json attention_mode: only gqa/mha is supported, found {mode!r}")


def _rope_theta(d: dict[str, Any]) -> float:
    """rope_theta from either the flat field or transformers 5's `rope_parameters`; only default RoPE."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for p in (params, scaling):
        kind = p.get("rope_type") or p.get("type")
        if kind not in (None, "default"):
            raise DrafterConfigError(f"config.json rope type: only default RoPE is supported, found {kind!r}")
    theta = d.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise DrafterConfigError("config.json: missing required field `rope_theta`")
    return float(theta)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's rule: evenly spread from layer 1 to layer num_target_layers-3 (middle layer for one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise DrafterConfigError(
            f"target has {num_target_layers} layers: too few to spread {num_draft_layers} target layer ids"
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ------------------------------------------------------------------------- a fresh drafter for a target
def new_drafter_config(target_config, kind: str = "dspine", num_layers: int = 5, block_size: int = 16,
                       target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                       settings: DSpineSettings | None = None) -> DrafterConfig:
    """The config of a fresh drafter for a transformers (Qwen3-style) target config; None: fitted defaults
    (target layer ids fit_target_layer_ids, mask token vocab_size - 1, DSpine settings scaled to the width)."""
    t = target_config
    n_target = int(t.num_hidden_layers)
    rope = getattr(t, "rope_parameters", None) or {}
    theta = getattr(t, "rope_theta", None) or rope.get("rope_theta")
    heads = int(t.num_attention_heads)
    d = {
        "architectures": [DSPINE_ARCH if kind == "dspine" else DFLASH_ARCH],
        "model_type": "qwen3",
        "hidden_size": int(t.hidden_size),
        "intermediate_size": int(t.intermediate_size),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(t, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(t, "head_dim", None) or t.hidden_size // heads),
        "vocab_size": int(t.vocab_size),
        "rms_norm_eps": float(t.rms_norm_eps),
        "rope_theta": float(theta if theta is not None else 10000.0),
        "max_position_embeddings": int(getattr(t, "max_position_embeddings", 40960)),
        "tie_word_embeddings": False,
        "attention_bias": bool(getattr(t, "attention_bias", False)),
        "hidden_act": "silu",
        "initializer_range": float(getattr(t, "initializer_range", 0.02)),
        "block_size": block_size,
        "is_causal": kind == "dspine",
        "num_target_layers": n_target,
        "dflash_config": {
            "mask_token_id": int(t.vocab_size) - 1 if mask_token_id is None else int(mask_token_id),
            "target_layer_ids": list(target_layer_ids or fit_target_layer_ids(n_target, num_layers)),
        },
    }
    if kind == "dspine":
        d["dspine_config"] = (settings or fresh_settings(int(t.hidden_size), int(t.vocab_size), {})).to_dict()
    return DrafterConfig.from_dict(d)


def fit_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers to read features from: DFlash's spread (layers 1 .. n-3) where it gives distinct
    ids; otherwise as many distinct ids as fit, spread over 1 .. n-2 (0 .. n-1 below 3 layers)."""
    n = num_target_layers
    if count == 1:
        return default_target_layer_ids(n, 1)
    if n - 3 > 1:
        ids = default_target_layer_ids(n, count)
        if len(set(ids)) == len(ids):
            return ids
    lo, hi = (1, n - 2) if n >= 3 else (0, n - 1)
    k = min(count, hi - lo + 1)
    if k == 1:
        return [(lo + hi) // 2]
    return [int(lo + i * (hi - lo) / (k - 1) + 0.5) for i in range(k)]  # floor(x + 0.5): distinct, increasing


def fresh_settings(hidden_size: int, vocab_size: int, overrides: dict[str, Any]) -> DSpineSettings:
    """DSpine settings for a fresh drafter: the reference's, with transfer rank and message size scaled to
    the width (DSpineSettings.scaled_for) unless given; a message size follows a given rank."""
    rank = overrides.get("transfer_rank", DSpineSettings.scaled_for(hidden_size, vocab_size).transfer_rank)
    return DSpineSettings(**{"transfer_rank": rank, "message_size": max(1, min(512, rank // 2)), **overrides})
