"""The training loop: set-up, optimizer steps over the data, metrics, checkpoint rotation and resume.

`train(TrainConfig)` is what `sglang-dspine train` runs (one process, or one per GPU under torchrun). A run's
output folder holds `train_config.json`, `metrics.jsonl`, `checkpoint-N/` (a drafter plus
`trainer_state.pt`; the newest `keep_checkpoints` are kept) and `final/`. A rerun into the same folder resumes
from its newest checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from typing import Any

import torch
from torch import nn

from .batching import Schedule, TokenData
from .blocks import make_blocks, sample_anchors
from .checkpoint import load_drafter, save_drafter
from .config import DrafterConfigError
from .distributed import all_reduce, barrier, setup_distributed, train_device
from .drafter_setup import build_drafter, trainable_parameters
from .model import DSpineDrafter
from .objective import TERM_NAMES, DrafterObjective, ObjectiveSwitches, assemble_loss
from .schedules import alignment_beta, default_gamma, lr_factor, replacement_probability
from .teacher import TargetTeacher
from .train_config import TrainConfig

# ======================================================================================= checkpoint folders


def _checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder name) of the `checkpoint-N` folders in a training output, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    return sorted((int(m.group(1)), d) for d in os.listdir(output_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def _latest_checkpoint(output_dir: str) -> str | None:
    steps = [(n, d) for n, d in _checkpoints(output_dir) if os.path.isfile(os.path.join(output_dir, d, "trainer_state.pt"))]
    return os.path.join(output_dir, steps[-1][1]) if steps else None


def resolve_checkpoint(path: str) -> str:
    """A drafter directory: `path` itself, or the latest `checkpoint-N` (or `final`) of a training output."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    latest = _latest_checkpoint(path)
    if latest:
        return latest
    final = os.path.join(path, "final")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    raise FileNotFoundError(f"{path}: neither a drafter checkpoint (config.json) nor a training output with checkpoints")


def _save_checkpoint(tc: TrainConfig, drafter: DSpineDrafter, opt, lr_sched, step: int, total_steps: int,
                     rank: int) -> str:
    """checkpoint-{step}: written to a temporary folder and renamed, so a crash never leaves a torn one; then
    all but the newest `keep_checkpoints` are removed."""
    path = os.path.join(tc.output_dir, f"checkpoint-{step}")
    if rank == 0:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp)
        torch.save({"optimizer": opt.state_dict(), "scheduler": lr_sched.state_dict(), "step": step,
                    "total_steps": total_steps, "train_config": tc.to_dict()}, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if tc.keep_checkpoints > 0:
            for _, d in _checkpoints(tc.output_dir)[: -tc.keep_checkpoints]:
                shutil.rmtree(os.path.join(tc.output_dir, d), ignore_errors=True)
    barrier()
    return path


# ================================================================================================ metrics


class MetricsLog:
    def __init__(self, path: str | None):
        self.path = path

    def write(self, rec: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")


def _metrics_record(red: dict[str, torch.Tensor], step: int, lr: float, beta: float, p_rep: float,
                    grad_norm) -> dict[str, Any]:
    """One metrics.jsonl record from the summed (all-reduced) terms and counts of a log interval."""
    d = red["denominator"].clamp_min(1e-9)
    rec: dict[str, Any] = {"step": step, "lr": lr, "beta": beta, "replacement_p": p_rep,
                           "loss": float(red["loss_num"] / d)}
    for k in TERM_NAMES:
        if k in red:
            rec[k] = float(red[k] / d)
    cnt = red["count_pos"]
    rec["accuracy"] = float(red["correct_pos"].sum() / cnt.sum().clamp_min(1))
    rec["accuracy_per_position"] = [round(float(c / max(float(n), 1.0)), 4) for c, n in zip(red["correct_pos"], cnt)]
    rec["candidate_coverage"] = float(red["coverage"] / cnt.sum().clamp_min(1))
    rec["backbone_accept_len"] = float(1 + red["lead_correct"] / red["full_blocks"].clamp_min(1))
    if grad_norm is not None:
        rec["grad_norm"] = float(grad_norm)
    return rec


# =================================================================================================== loop


def _autocast(device: torch.device, bf16: bool):
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(tc: TrainConfig, target=None, on_step=None) -> dict[str, Any]:
    """Train a drafter; returns a summary (steps, last metrics, output paths). `on_step(step)` is called after
    every optimizer step (a profiler's `step`, in benchmarks/train_step.py)."""
    with torch.enable_grad():  # whatever the caller's grad mode
        return Trainer(tc, target).run(on_step)


class Trainer:
    """One training run: built from a TrainConfig (and optionally a loaded target), run once."""

    def __init__(self, tc: TrainConfig, target=None):
        tc.validate()
        self.tc = tc
        self.rank, self.world, local = setup_distributed()
        self.device, self.bf16 = train_device(tc)
        torch.manual_seed(tc.seed)

        if target is None:
            if not tc.target:
                raise ValueError("train: give a target (--target PATH)")
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(tc.target, dtype=torch.bfloat16 if self.bf16 else torch.float32)
        target = target.to(self.device)
        self.teacher = TargetTeacher(target)

        os.makedirs(tc.output_dir, exist_ok=True)
        self.resume_from = _latest_checkpoint(tc.output_dir) if tc.resume else None
        if self.resume_from:
            drafter = load_drafter(self.resume_from, target_head=self.teacher.head.detach().float().cpu())
        else:
            drafter = build_drafter(tc, self.teacher)
        self.drafter = drafter.to(device=self.device, dtype=torch.float32)
        self.cfg = cfg = self.drafter.cfg
        if cfg.kind != tc.kind:
            raise DrafterConfigError(f"train: kind {tc.kind!r} but the drafter in use is a {cfg.kind} drafter")
        self.params = trainable_parameters(self.drafter, tc.freeze_backbone)
        self.gamma = tc.gamma if tc.gamma is not None else default_gamma(cfg.block_size)
        self.switches = ObjectiveSwitches(tc.backbone_loss, tc.refinement_loss, tc.alignment_loss, tc.replacement)
        self.objective = DrafterObjective(self.drafter, self.teacher, self.switches, tc.dflash_ce_weight,
                                          tc.coverage_k, tc.objective_chunk_blocks).to(self.device)
        self.model: nn.Module = self.objective
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.objective, device_ids=[local] if self.device.type == "cuda" else None,
                             broadcast_buffers=False)

        self.data = TokenData(tc.data, tc.max_length)
        self.sched = Schedule(len(self.data), tc.batch_size, tc.grad_accum, self.world, tc.seed)
        self.total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * self.sched.steps_per_epoch()))
        self._make_optimizer()
        self.step = 0
        if self.resume_from:
            self._load_trainer_state(self.resume_from)
        if self.rank == 0:
            with open(os.path.join(tc.output_dir, "train_config.json"), "w", encoding="utf-8") as f:
                json.dump({**tc.to_dict(), "gamma_used": self.gamma, "total_steps": self.total_steps,
                           "world_size": self.world}, f, indent=2)
        self.log = MetricsLog(os.path.join(tc.output_dir, "metrics.jsonl") if self.rank == 0 else None)

    def _make_optimizer(self) -> None:
        tc, params = self.tc, self.params
        warmup = int(tc.warmup_ratio * self.total_steps)
        total = self.total_steps
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2), fused=self.device.type == "cuda")
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, warmup, total, tc.min_lr_ratio))

    def _load_trainer_state(self, folder: str) -> None:
        state = torch.load(os.path.join(folder, "trainer_state.pt"), map_location="cpu", weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.lr_sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if state.get("total_steps") != self.total_steps:
            raise ValueError(f"resume {folder}: total_steps changed ({state.get('total_steps')} -> {self.total_steps}); "
                             "the schedules would not continue; use the same data/epochs/batch settings or a new output dir")

    # ------------------------------------------------------------------------------------------ one step
    def _micro_batches(self, step: int, p_rep: float) -> tuple[list, int]:
        """Inputs of every micro-batch of a step: the target's outputs and the blocks (anchors, replacement);
        and the number of response tokens they hold."""
        tc, cfg, device = self.tc, self.cfg, self.device
        region = torch.profiler.record_function  # named parts of a step in a profile; nothing otherwise
        micro, tokens = [], 0
        for j in range(tc.grad_accum):
            g = torch.Generator().manual_seed((tc.seed * 1_000_003 + step * 7919 + j * 131 + self.rank) % (2**63))
            with region("train.data"):
                ids, mask = self.data.batch(self.sched.indices(step, j, self.rank), device)
            with region("train.target"):
                feats, last_hidden = self.teacher.run(ids, cfg.target_layer_ids)
            with region("train.blocks"):
                anchors, keep = sample_anchors(mask, tc.num_anchors, g)
                blocks = make_blocks(ids, mask, anchors, keep, cfg.block_size, cfg.mask_token_id, self.gamma)
                if p_rep > 0:
                    blocks.replace = (torch.rand(keep.shape, generator=g) < p_rep).to(device) & keep
            micro.append((feats, last_hidden, blocks))
            tokens += int(mask.sum())
        return micro, tokens

    def _train_step(self, step: int, acc: dict[str, torch.Tensor]) -> tuple[float, float, float, Any, int]:
        """One optimizer step; adds its terms to `acc`. Returns (β, replacement p, lr, grad norm, tokens)."""
        tc, cfg, world = self.tc, self.cfg, self.world
        region = torch.profiler.record_function
        s_settings = cfg.dspine
        beta = alignment_beta(step, s_settings) if cfg.is_dspine and self.switches.alignment else 0.0
        p_rep = (replacement_probability(step, self.total_steps, s_settings)
                 if cfg.is_dspine and self.switches.replacement else 0.0)
        # 1. inputs of every micro-batch of this step
        micro, tokens = self._micro_batches(step, p_rep)
        denom = all_reduce(torch.stack([b.denominator for *_, b in micro]).sum().detach().clone())
        scale = world / denom.clamp_min(1.0)
        # 2. the global mean CE that scales the alignment term (a no-grad prepass when accumulating)
        mean_ce: torch.Tensor | float = 0.0
        if beta > 0 and tc.grad_accum > 1:
            with torch.no_grad(), _autocast(self.device, self.bf16):
                ce_sum = sum(self.objective(f, h, b, ce_only=True)["ce"] for f, h, b in micro)
            mean_ce = all_reduce(ce_sum.detach().float().clone()) / denom.clamp_min(1.0)
        # 3. graded passes
        self.model.train()
        for j, (feats, last_hidden, blocks) in enumerate(micro):
            sync = j == len(micro) - 1 or world == 1
            ctx = self.model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                with _autocast(self.device, self.bf16), region("train.forward"):
                    terms = self.model(feats, last_hidden, blocks)
                if beta > 0 and tc.grad_accum == 1:
                    mean_ce = all_reduce(terms["ce"].detach().float().clone()) / denom.clamp_min(1.0)
                num = assemble_loss(terms, self.objective.ce_weight, self.switches, cfg.is_dspine, beta, mean_ce)
                with region("train.backward"):
                    (num * scale).backward()
            for k, v in terms.items():
                v = v.detach().float()
                acc[k] = acc[k] + v if k in acc else v.clone()
            acc["loss_num"] = acc.get("loss_num", 0.0) + num.detach().float()
        with region("train.optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, tc.max_grad_norm) if tc.max_grad_norm > 0 else None
            lr_now = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.lr_sched.step()
            self.opt.zero_grad(set_to_none=True)
        return beta, p_rep, lr_now, grad_norm, tokens

    # ------------------------------------------------------------------------------------------- the run
    def run(self, on_step=None) -> dict[str, Any]:
        from tqdm import tqdm

        tc, total = self.tc, self.total_steps
        bar = tqdm(total=total, initial=self.step, desc=f"train {self.cfg.kind}",
                   disable=not tc.progress or self.rank != 0, dynamic_ncols=True)
        acc: dict[str, torch.Tensor] = {}
        acc_steps, t0, tokens = 0, time.time(), 0
        last: dict[str, Any] = {}
        while self.step < total:
            beta, p_rep, lr_now, grad_norm, n_tok = self._train_step(self.step, acc)
            tokens += n_tok
            self.step += 1
            step = self.step
            acc_steps += 1
            bar.update(1)
            if step % tc.log_every == 0 or step == total:
                red = {k: all_reduce(v) for k, v in acc.items()}  # acc is rebuilt after logging: reduce in place
                rec = _metrics_record(red, step, lr_now, beta, p_rep, grad_norm)
                dt = time.time() - t0
                rec["tokens_per_s"] = tokens * self.world / max(dt, 1e-9)
                rec["interval_steps"], rec["interval_seconds"] = acc_steps, round(dt, 4)
                self.log.write(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['accuracy']:.3f}")
                last = rec
                acc, acc_steps, t0, tokens = {}, 0, time.time(), 0
            if tc.save_every and step % tc.save_every == 0 and step < total:
                _save_checkpoint(tc, self.drafter, self.opt, self.lr_sched, step, total, self.rank)
            if on_step is not None:
                on_step(step)
        bar.close()
        ckpt = _save_checkpoint(tc, self.drafter, self.opt, self.lr_sched, self.step, total, self.rank)
        final = os.path.join(tc.output_dir, "final")
        if self.rank == 0:
            save_drafter(self.drafter, final)
        barrier()
        return {"steps": self.step, "total_steps": total, "final": final, "checkpoint": ckpt, "last_metrics": last,
                "gamma": self.gamma, "dropped_sequences": self.data.dropped}
