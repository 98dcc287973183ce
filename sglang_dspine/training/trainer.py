"""The training loop: set-up, optimizer steps over the data, metrics, checkpoint rotation and resume.

`train(TrainConfig)` is what `sglang-dspine train` runs (one process, or one per GPU under torchrun). A run's
output folder holds `train_config.json`, `metrics.jsonl` (and `tensorboard/`, metrics.py), `checkpoint-N/`
(a drafter plus `trainer_state.pt`; the newest `keep_checkpoints` are kept; one every `save_minutes` and every
`save_every` steps, and one when SIGINT/SIGTERM stops the run: interrupt.py) and `final/`. With `resume`, a run
into the same folder resumes from its newest checkpoint (the CLI first checks the settings match: run_folder.py).
`trainer_state.pt` holds only tensors and plain data (optimizer and schedule state, step, RNG states as tensors)
and is read with `weights_only=True`: a state file that would run code when unpickled is refused.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import shutil
import sys
import time
from typing import Any

import torch
from torch import nn

from ..drafter.checkpoint import load_drafter, save_drafter
from ..drafter.config import DrafterConfigError
from ..drafter.model import DSpineDrafter
from ..profiling import region
from .batching import Schedule, TokenData
from .blocks import make_blocks, sample_anchors
from .distributed import all_reduce, barrier, local_rank, setup_distributed, train_device
from .drafter_setup import build_drafter, recipe_alignment_decay, recipe_line, trainable_parameters
from .interrupt import Interrupted, stop_requests
from .metrics import MetricsSink
from .objective import DrafterObjective, LossAssembly, ObjectiveSwitches
from .outputs import readable_by_all
from .schedules import alignment_beta, default_gamma, lr_factor, replacement_probability
from .target_loading import load_tokenizer
from .teacher import TargetTeacher
from .train_config import TrainConfig

# ======================================================================================= checkpoint folders


def _checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder name) of the `checkpoint-N` folders in a training output, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    return sorted((int(m.group(1)), d) for d in os.listdir(output_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def _latest_checkpoint(output_dir: str) -> str | None:
    steps = [(n, d) for n,
             d in _checkpoints(output_dir) if os.path.isfile(os.path.join(output_dir, d, "trainer_state.pt"))]
    return os.path.join(output_dir, steps[-1][1]) if steps else None


def resolve_checkpoint(path: str) -> str:
    """A drafter directory: `path` itself, or the latest `checkpoint-N` (or `final`) of a training output."""
    if not path:  # "" would otherwise mean the working directory
        raise FileNotFoundError("an empty path; expected a drafter directory")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: {'a file' if os.path.exists(path) else 'no such directory'}; "
                                "expected a drafter directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    latest = _latest_checkpoint(path)
    if latest:
        return latest
    final = os.path.join(path, "final")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    raise FileNotFoundError(f"{path}: neither a drafter checkpoint (config.json) "
                            "nor a training output with checkpoints")


def _rng_state() -> dict[str, Any]:
    """The global RNG states as tensors (loadable with weights_only=True)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _save_checkpoint(tc: TrainConfig, drafter: DSpineDrafter, opt, lr_sched, step: int, total_steps: int,
                     rank: int, world: int) -> str:
    """checkpoint-{step}: written to a temporary folder and renamed, so a crash never leaves a torn one; then
    all but the newest `keep_checkpoints` are removed."""
    path = os.path.join(tc.output_dir, f"checkpoint-{step}")
    if rank == 0:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp)
        torch.save({"optimizer": opt.state_dict(), "scheduler": lr_sched.state_dict(), "step": step,
                    "total_steps": total_steps, "train_config": tc.to_dict(), "rng": _rng_state()},
                   os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if tc.keep_checkpoints > 0:
            for _, d in _checkpoints(tc.output_dir)[: -tc.keep_checkpoints]:
                shutil.rmtree(os.path.join(tc.output_dir, d), ignore_errors=True)
    if world > 1:
        barrier()
    return path


def load_trainer_state(folder: str) -> dict[str, Any]:
    """A checkpoint's trainer_state.pt, read with weights_only=True: tensors and plain data only. A file that
    would run code (or hold anything else) when unpickled is refused, never executed."""
    path = os.path.join(folder, "trainer_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DrafterConfigError(f"resume {path}: refused: not a plain trainer state (tensors, numbers, strings, "
                                 f"lists and dicts only): {first}") from None
    missing = {"optimizer", "scheduler", "step"} - set(state) if isinstance(state, dict) else {"a dict"}
    if missing:
        raise DrafterConfigError(f"resume {path}: not a trainer state (missing {sorted(missing)})")
    return state


# ================================================================================================ metrics


def _metrics_record(red: dict[str, torch.Tensor], assembly: LossAssembly, step: int, lr: float, beta: float,
                    p_rep: float, grad_norm) -> dict[str, Any]:
    """One metrics.jsonl record from the summed (all-reduced) terms and counts of a log interval; the loss and its
    terms as `assembly` logs them."""
    rec: dict[str, Any] = {"step": step, "lr": lr, "beta": beta, "replacement_p": p_rep, **assembly.logged(red)}
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


def train(tc: TrainConfig, target=None, on_step=None, single_process: bool = False) -> dict[str, Any]:
    """Train a drafter; returns a summary (steps, last metrics, output paths). `on_step(step)` is called after
    every optimizer step (a profiler's `step`, in benchmarks/train_step.py). single_process: train in this
    process alone even under torchrun (benchmarks/train_scale.py's one-GPU run while the other ranks wait)."""
    with torch.enable_grad():  # whatever the caller's grad mode
        return Trainer(tc, target, single_process).run(on_step)


class Trainer:
    """One training run: built from a TrainConfig (and optionally a loaded target), run once."""

    def __init__(self, tc: TrainConfig, target=None, single_process: bool = False):
        tc.validate()
        self.tc = tc
        if single_process:
            self.rank, self.world, local = 0, 1, local_rank()
        else:
            self.rank, self.world, local = setup_distributed()
        self.device, self.bf16 = train_device(tc)
        torch.manual_seed(tc.seed)

        if target is None:
            if not tc.target:
                raise ValueError("train: give a target (--target PATH)")
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(tc.target,
                                                          dtype=torch.bfloat16 if self.bf16 else torch.float32)
        target = target.to(self.device)
        self.teacher = TargetTeacher(target)

        os.makedirs(tc.output_dir, exist_ok=True)
        self.tokenizer = load_tokenizer(tc.tokenizer, tc.target)
        # the data before the drafter: a bad file fails fast, before a large head's transfer space is computed
        self.data = TokenData(tc.data, tc.max_length, self.tokenizer, tc.chat_template, tc.enable_thinking,
                              tc.last_turn_only, vocab_size=int(self.teacher.config.vocab_size),
                              progress=tc.progress and self.rank == 0)
        self.resume_from = _latest_checkpoint(tc.output_dir) if tc.resume else None
        if self.resume_from:
            drafter = load_drafter(self.resume_from, target_head=self.teacher.head.detach().float().cpu())
            self.mask_source = f"the checkpoint resumed ({self.resume_from})"
        else:
            drafter, self.mask_source = build_drafter(tc, self.teacher, self.tokenizer)
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

        self.sched = Schedule(len(self.data), tc.batch_size, tc.grad_accum, self.world, tc.seed)
        self.total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * self.sched.steps_per_epoch()))
        self._make_optimizer()
        self.step = 0
        if self.resume_from:
            self._load_trainer_state(self.resume_from)
        drafter_used = {"num_draft_layers": cfg.num_hidden_layers, "target_layer_ids": cfg.target_layer_ids,
                        "mask_token_id": cfg.mask_token_id, "mask_token_source": self.mask_source,
                        "dspine": cfg.dspine.to_dict() if cfg.dspine else None}
        self.log = None
        if self.rank == 0:
            with open(os.path.join(tc.output_dir, "train_config.json"), "w", encoding="utf-8") as f:
                json.dump({**tc.to_dict(), "gamma_used": self.gamma, "total_steps": self.total_steps,
                           "world_size": self.world, "drafter": drafter_used}, f, indent=2)
            extra = f", transfer rank {cfg.dspine.transfer_rank}" if cfg.dspine else ""
            if cfg.dspine:
                extra += "; " + recipe_line(cfg)
            print(f"train: {cfg.kind} drafter, {cfg.num_hidden_layers} layers, target layers {cfg.target_layer_ids}, "
                  f"mask token {cfg.mask_token_id} ({self.mask_source}){extra}; {len(self.data)} sequences, "
                  f"{self.total_steps} steps", file=sys.stderr)
            print(f"train: the objective's vocabulary-sized terms on {self.objective.vocab_path(self.device)}",
                  file=sys.stderr)
            self.log = MetricsSink(tc.output_dir, tc.tensorboard, tc.wandb_project, tc.run_name,
                                   {**tc.to_dict(), "drafter": drafter_used})

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce(t) if self.world > 1 else t

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
        state = load_trainer_state(folder)
        if state.get("total_steps") != self.total_steps:
            raise DrafterConfigError(
                f"resume {folder}: total_steps changed ({state.get('total_steps')} -> {self.total_steps}); the "
                "schedules would not continue; use the same data/epochs/batch settings, or --overwrite / a new "
                "--output-dir")
        self.opt.load_state_dict(state["optimizer"])
        self.lr_sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        rng = state.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(rng["cuda"])

    # ------------------------------------------------------------------------------------------ one step
    def _micro_batches(self, step: int, p_rep: float) -> tuple[list, int]:
        """Inputs of every micro-batch of a step: the target's outputs and the blocks (anchors, replacement);
        and the number of response tokens they hold."""
        tc, cfg, device = self.tc, self.cfg, self.device
        micro, tokens = [], 0
        for j in range(tc.grad_accum):
            # seeded by the micro-batch's place in the global batch: N ranks draw the blocks that one
            # process with N times the accumulation draws (the sequences line up too: Schedule)
            micro_index = j * self.world + self.rank
            g = torch.Generator().manual_seed((tc.seed * 1_000_003 + step * 7919 + micro_index * 131) % (2**63))
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
        beta, p_rep, tokens = self._gradients(step, acc)
        with region("train.optimizer"):
            max_norm = self.tc.max_grad_norm
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm) if max_norm > 0 else None
            lr_now = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.lr_sched.step()
            self.opt.zero_grad(set_to_none=True)
        return beta, p_rep, lr_now, grad_norm, tokens

    def _gradients(self, step: int, acc: dict[str, torch.Tensor]) -> tuple[float, float, int]:
        """The gradients of one optimizer step (all micro-batches); adds its terms to `acc`. Returns (β,
        replacement p, tokens)."""
        cfg, world = self.cfg, self.world
        s_settings = cfg.dspine
        beta = (alignment_beta(step, s_settings, self.total_steps, recipe_alignment_decay(cfg))
                if cfg.is_dspine and self.switches.alignment else 0.0)
        p_rep = (replacement_probability(step, self.total_steps, s_settings)
                 if cfg.is_dspine and self.switches.replacement else 0.0)
        # 1. inputs of every micro-batch of this step
        micro, tokens = self._micro_batches(step, p_rep)
        denom = self._reduce(torch.stack([b.denominator for *_, b in micro]).sum().detach().clone())
        scale = world / denom.clamp_min(1.0)
        assembly = self.objective.assembly(beta)
        # 2. the step CE scales the alignment term, so it is needed before the first backward: the first
        # micro-batch's CE comes from its graded pass, the others' from a no-grad pass before it
        step_ce = None
        later_ce: list[torch.Tensor] = []
        if assembly.needs_step_ce and len(micro) > 1:
            with torch.no_grad(), _autocast(self.device, self.bf16), region("train.ce_prepass"):
                later_ce = [self.objective(f, h, b, ce_only=True)["ce"] for f, h, b in micro[1:]]
        # 3. graded passes
        self.model.train()
        for j, (feats, last_hidden, blocks) in enumerate(micro):
            sync = j == len(micro) - 1 or world == 1
            ctx = self.model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                with _autocast(self.device, self.bf16), region("train.forward"):
                    terms = self.model(feats, last_hidden, blocks)
                if assembly.needs_step_ce and j == 0:
                    step_ce = assembly.step_ce([terms["ce"], *later_ce], denom, self._reduce)
                num = assembly.numerator(terms, step_ce)
                with region("train.backward"):
                    (num * scale).backward()
            for k, v in terms.items():
                v = v.detach().float()
                acc[k] = acc[k] + v if k in acc else v.clone()
            acc["loss_num"] = acc.get("loss_num", 0.0) + num.detach().float()
        return beta, p_rep, tokens

    # ------------------------------------------------------------------------------------------- the run
    def _agree(self, stop: bool, due: bool) -> tuple[bool, bool]:
        """(stop, save now) as every rank sees them: a signal reaches the ranks at different steps, and a
        checkpoint's barrier hangs unless all of them save at the same step (rank 0's clock decides `due`)."""
        if self.world == 1:
            return stop, due
        t = self._reduce(torch.tensor([float(stop), float(due and self.rank == 0)], device=self.device))
        return bool(t[0] > 0), bool(t[1] > 0)

    def _save(self, step: int) -> str:
        return _save_checkpoint(self.tc, self.drafter, self.opt, self.lr_sched, step, self.total_steps, self.rank,
                                self.world)

    def run(self, on_step=None) -> dict[str, Any]:
        # a signal during the loop or the final save is deferred to a step's end (interrupt.py)
        with stop_requests() as stop:
            return self._run(stop, on_step)

    def _run(self, stop, on_step=None) -> dict[str, Any]:
        from tqdm import tqdm

        tc, total = self.tc, self.total_steps
        bar = tqdm(total=total, initial=self.step, desc=f"train {self.cfg.kind}",
                   disable=not tc.progress or self.rank != 0, dynamic_ncols=True)
        acc: dict[str, torch.Tensor] = {}
        acc_steps, t0, tokens = 0, time.time(), 0
        last: dict[str, Any] = {}
        last_save = time.time()
        while self.step < total:
            beta, p_rep, lr_now, grad_norm, n_tok = self._train_step(self.step, acc)
            tokens += n_tok
            self.step += 1
            step = self.step
            acc_steps += 1
            bar.update(1)
            if step % tc.log_every == 0 or step == total:
                red = {k: self._reduce(v) for k, v in acc.items()}  # acc is rebuilt after logging: reduce in place
                rec = _metrics_record(red, self.objective.assembly(), step, lr_now, beta, p_rep, grad_norm)
                dt = time.time() - t0
                rec["tokens_per_s"] = tokens * self.world / max(dt, 1e-9)
                rec["interval_steps"], rec["interval_seconds"] = acc_steps, round(dt, 4)
                if self.log is not None:
                    self.log.write(rec)
                bar.set_postfix({"loss": f"{rec['loss']:.3f}", "acc": f"{rec['accuracy']:.3f}",
                                 "tok/s": f"{rec['tokens_per_s']:.0f}"})
                last = rec
                acc, acc_steps, t0, tokens = {}, 0, time.time(), 0
            due = bool(tc.save_minutes) and time.time() - last_save >= 60 * tc.save_minutes
            stopping, due = self._agree(stop.requested, due)
            if stopping:
                ckpt = self._save(step) if tc.save else None
                bar.close()
                if self.log is not None:
                    self.log.close()
                raise Interrupted(step, total, ckpt)
            if tc.save and step < total and (due or (tc.save_every and step % tc.save_every == 0)):
                self._save(step)
                last_save = time.time()
            if on_step is not None:
                on_step(step)
        bar.close()
        if self.log is not None:
            self.log.close()
        ckpt = final = None
        if tc.save:
            ckpt = self._save(self.step)
            final = os.path.join(tc.output_dir, "final")
            if self.rank == 0:
                save_drafter(self.drafter, final)
                readable_by_all(final)
            if self.world > 1:
                barrier()
        return {"steps": self.step, "total_steps": total, "final": final, "checkpoint": ckpt, "last_metrics": last,
                "gamma": self.gamma, "dropped_sequences": self.data.dropped}
