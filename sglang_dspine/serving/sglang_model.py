"""DSpineDraftModel for SGLang: the DFlash draft model plus adjacent injection after every layer.

The backbone is SGLang's `DFlashDraftModel` unchanged (RadixAttention over the draft KV pool, fused
linears, context K/V written by the DFlash worker); `is_causal: true` in the config makes its block
attention causal. This class adds what DSpine needs on top:
- the injection after every layer on the flat [bs*B, H] block layout, through its `DraftStep`
  (`draft_step.py`), which also decodes the block for the worker. SGLang defers the residual add, so the
  layer's state is `hidden + residual`; the injection hands back a (hidden, residual) pair whose sum is the
  injected state, so SGLang's next fused add-RMSNorm does the add;
- `post_load_weights`, which SGLang's loaders call however the weights arrive (files or `--load-format
  dummy`): it sets up the draft step, so a dummy-loaded drafter runs the same path as a loaded one;
- a strict weight loader: SGLang's DFlash loader silently drops names it does not know (the transfer codes
  and injection weights among them) and never reports missing ones.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.models.dflash import DFlashDraftModel

from ..drafter.checkpoint import (
    CODES_KEY,
    READY_KEY,
    RELEASE_CODES,
    check_dspine_transfer,
    load_state_strict,
    resolve_transfer_codes,
)
from ..drafter.config import DrafterConfig, DrafterConfigError
from ..drafter.injection import AdjacentInjection
from ..drafter.model import DSpineDrafter
from . import draft_step

logger = logging.getLogger(__name__)


class DSpineDraftModel(DFlashDraftModel):
    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self.cfg = DrafterConfig.from_dict(config.to_dict())  # validated, as the plain drafter's `cfg`
        if not self.cfg.is_dspine:
            raise DrafterConfigError(f"DSpineDraftModel needs a DSpine config, found a {self.cfg.kind} one")
        s, h = self.cfg.dspine, int(config.hidden_size)
        self.injection = AdjacentInjection(h, s.transfer_rank, s.message_size, len(self.layers))
        self.register_buffer("transfer_codes", torch.zeros(int(config.vocab_size), s.transfer_rank))
        self.register_buffer("transfer_ready", torch.tensor(False))
        self.top_k = s.top_k
        self.draft_step: draft_step.DraftStep | None = None  # set up once the weights are in

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False,
                pp_proxy_tensors=None) -> LogitsProcessorOutput:
        if input_embeds is None:
            raise ValueError("DSpineDraftModel requires `input_embeds` (the target's embedding of the block)")
        if self.draft_step is None:
            raise RuntimeError("DSpineDraftModel.forward before its weights were loaded")
        b = self.block_size
        n = input_embeds.shape[0]
        if n == 0:
            return LogitsProcessorOutput(next_token_logits=None, hidden_states=input_embeds)
        if n % b:
            raise ValueError(f"DSpineDraftModel: {n} tokens is not a whole number of blocks of {b}")
        step = self.draft_step
        step.begin(input_ids.view(-1, b)[:, 0])
        x, residual = input_embeds, None
        for l, layer in enumerate(self.layers):
            x, residual = layer(positions, x, forward_batch, residual)
            x, residual = step.inject(x + residual, l)  # the layer's full state (SGLang defers this add)
        hidden = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        ours: dict[str, torch.Tensor] = {}
        seen: set[str] = set()

        def backbone():
            for name, w in weights:
                key = name[len("model."):] if name.startswith("model.") else name
                seen.add(CODES_KEY if key == RELEASE_CODES else key)
                if key.startswith("injection.") or key in (CODES_KEY, READY_KEY, RELEASE_CODES):
                    ours[key] = w
                else:
                    yield name, w

        super().load_weights(backbone())
        self._check_names(seen)
        # With a sharded checkpoint SGLang reads only the files the index names, not transfer.safetensors.
        resolve_transfer_codes(ours, getattr(self.config, "_name_or_path", "") or "", self.cfg)
        own = {k for k in self.state_dict() if k.startswith("injection.") or k in (CODES_KEY, READY_KEY)}
        load_state_strict(self, ours, "DSpine drafter", names=own)
        check_dspine_transfer(self, "DSpine drafter")
        self._set_up_draft_step("files")

    def post_load_weights(self) -> None:
        """Called by SGLang's loaders that bypass `load_weights` (`--load-format dummy` among them)."""
        self._set_up_draft_step("dummy")

    def _set_up_draft_step(self, weights_from: str) -> None:
        if self.draft_step is None:  # once: a loader may call both
            self.draft_step = draft_step.choose(self, weights_from)

    def _check_names(self, seen: set[str]) -> None:
        """Every tensor the plain drafter defines must arrive, and nothing else (SGLang's loader would not say)."""
        with torch.device("meta"):
            expected = set(DSpineDrafter(self.cfg).state_dict())
        expected.discard(READY_KEY)  # optional in the release layout
        missing = sorted(expected - seen)
        if missing == [CODES_KEY]:
            return  # may come from transfer.safetensors beside a sharded checkpoint; checked by the caller
        unexpected = sorted(seen - expected - {READY_KEY})
        if missing or unexpected:
            raise DrafterConfigError(
                f"DSpine drafter checkpoint: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}"
            )


EntryClass = [DSpineDraftModel]
