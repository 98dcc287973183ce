"""`sglang-dspine` command line: data, train, export, eval.

Subcommands live in a small registry: each adds itself with

    register_command("name", "one-line help", add_arguments, run)   # run(args) -> exit code or None
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

from .training.outputs import check_writable_dir, check_writable_file, readable_by_all
from .training.target_loading import CLIError, check_model_dir, default_device, dtype_of, load_target, load_tokenizer


@dataclass
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: dict[str, Command] = {}


def register_command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int | None]) -> None:
    if name in COMMANDS and COMMANDS[name].run is not run:
        raise ValueError(f"sglang-dspine: subcommand {name!r} registered twice")
    COMMANDS[name] = Command(name, help, add_arguments, run)


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _path(v: str) -> str:
    if not v:  # "" would mean the working directory to os.path.join
        raise argparse.ArgumentTypeError("expected a path, found an empty string")
    return v


def _thinking(v: str) -> bool | None:
    return {"on": True, "off": False, "auto": None}[v]


def _int_list(v: str) -> list[int]:
    try:
        ids = [int(x) for x in v.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {v!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected token ids >= 0, found {v!r}")
    return ids


def _bounded(kind: type, want: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` for which `ok` holds (finite, for floats); argparse names the flag
    in its one-line error."""
    def parse(v: str):
        try:
            x = kind(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"found {v!r}") from None
        if not (math.isfinite(x) and ok(x)):
            raise argparse.ArgumentTypeError(f"expected {want}, found {v}")
        return x

    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording for anything else
    return parse


_COUNT = _bounded(int, ">= 1", lambda x: x >= 1)
_SEED = _bounded(int, ">= 0", lambda x: x >= 0)
_NON_NEGATIVE = _bounded(float, ">= 0", lambda x: x >= 0)
_TOP_P = _bounded(float, "in (0, 1]", lambda x: 0 < x <= 1)
_FRACTION = _bounded(float, "in (0, 1)", lambda x: 0 < x < 1)


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", metavar="NAME_OR_FILE",
                   help="chat template: a Jinja file, a template name the tokenizer carries, or built-in `chatml` / "
                        "`plain` (the messages' text, for base models); default: the tokenizer's own (an error "
                        "when it has none)")
    p.add_argument("--thinking", choices=["on", "off", "auto"], default="auto",
                   help="enable_thinking for chat templates that read it (auto: the template's default)")


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", type=_path, help="tokenizer path (default: the target's)")
    _add_chat_args(p)
    p.add_argument("--system-prompt", help="a system message put in front of every chat")
    p.add_argument("--split", default="train", help="split of a datasets dataset (default: train)")
    p.add_argument("--limit", type=_COUNT, help="use only the first N prompts (default: all)")


# ---------------------------------------------------------------------------------------------- data
def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=_path, required=True,
                   help="target model directory (transformers / SGLang), or a hub repo id")
    p.add_argument("--prompts", type=_path, required=True,
                   help="JSONL with `prompt`, `messages`/`conversations` or `prompt_ids` per line, or a datasets "
                        "dataset")
    p.add_argument("--output", type=_path, required=True,
                   help="output JSONL of token ids, its settings recorded beside it (OUTPUT.settings.json): a rerun "
                        "with the same prompts file and settings resumes it, another one is refused naming what "
                        "differs")
    p.add_argument("--no-regenerate", dest="regenerate", action="store_false",
                   help="conversations that already hold the target's answers (SpecForge's `conversations` JSONL): "
                        "tokenise them with the chat template, loss on every assistant turn; the target does not run")
    p.add_argument("--last-turn-only", action="store_true",
                   help="with --no-regenerate: loss on the last assistant turn only")
    _add_prompt_args(p)
    p.add_argument("--backend", choices=["auto", "sglang", "hf"], default="auto",
                   help="auto: SGLang's offline engine on a GPU, transformers generation on CPU")
    p.add_argument("--max-new-tokens", type=_COUNT, default=2048,
                   help="response tokens at most; a prompt with no room for them in the target's context "
                        "(max_position_embeddings) is skipped, and the skipped ones counted")
    p.add_argument("--temperature", type=_NON_NEGATIVE, default=0.0,
                   help="0 = greedy (the reference regenerates greedily)")
    p.add_argument("--top-p", type=_TOP_P, default=1.0)
    p.add_argument("--max-prompt-len", type=_COUNT,
                   help="skip prompts longer than this many tokens (default: no limit)")
    p.add_argument("--batch-size", type=_COUNT, default=256, help="prompts per engine call (written after each)")
    p.add_argument("--eos-token-id", type=_int_list, default=[], help="extra end tokens, comma-separated")
    p.add_argument("--tp-size", type=_COUNT, default=1, help="SGLang tensor parallel size")
    p.add_argument("--dp-size", type=_COUNT, default=1, help="SGLang data parallel size")
    p.add_argument("--mem-fraction-static", type=_FRACTION, help="SGLang static memory fraction (default: SGLang's)")
    p.add_argument("--dtype", help="target dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", help="device for the transformers backend (default: cuda if present)")
    p.add_argument("--max-seconds", type=_NON_NEGATIVE,
                   help="start no new batch after this many seconds (a rerun resumes where it stopped; default: no "
                        "limit)")
    p.add_argument("--hf-batch-size", type=_COUNT, default=1,
                   help="transformers backend: prompts generated at once, left-padded (1: one at a time, exact)")
    p.add_argument("--seed", type=_SEED, default=0)
    p.add_argument("--no-progress", action="store_true")


def check_records(flag: str, path: str, what: str) -> None:
    """A local JSONL input read through once before any model loads (an 8B target takes minutes to load): a line
    that is not a JSON object, or a file with no record, is refused naming the flag; so is a missing file, unless
    the name can be a `datasets` one (left to its loader)."""
    from .training.jsonl import DataError, iter_jsonl

    if not os.path.exists(path):
        import importlib.util

        # a hub dataset is `name` or `org/name`: no extension, no leading . or /, no local folder before the /
        looks_local = (os.path.isabs(path) or path.startswith(".") or os.path.splitext(path)[1] != ""
                       or ("/" in path and os.path.isdir(os.path.dirname(path))))
        if looks_local or importlib.util.find_spec("datasets") is None:
            raise CLIError(f"{flag} {path}: no such file")
        return
    if not os.path.isfile(path):
        return
    try:
        n = sum(1 for _ in iter_jsonl(path))
    except DataError as e:
        raise CLIError(f"{flag} {e}") from None
    if n == 0:
        raise CLIError(f"{flag} {path}: empty (no {what} in it)")


def target_context(target: str) -> int | None:
    """The target's context (max_position_embeddings) from its config.json, read without loading it (None for a
    hub id or a config without one)."""
    from .drafter.config import read_json

    path = os.path.join(target, "config.json")
    if not os.path.isfile(path):
        return None
    cfg = read_json(path)
    cfg = cfg.get("text_config") or cfg
    n = cfg.get("max_position_embeddings")
    return int(n) if isinstance(n, int) and n > 0 else None


def _data_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What shapes a `data` output's records, by flag (training/data_settings.py records and compares them)."""
    from .training.data_settings import PROMPTS_DIGEST, digest

    skip = {"command", "output", "no_progress", "_run"}
    out: dict[str, Any] = {f"--{k.replace('_', '-')}": v for k, v in vars(args).items() if k not in skip}
    out["--no-regenerate"] = not out.pop("--regenerate")
    out[PROMPTS_DIGEST] = digest(args.prompts)
    return out


def _data_run(args: argparse.Namespace) -> int:
    from .training.data_settings import check_and_record, settings_path

    check_model_dir("--target", args.target)
    check_records("--prompts", args.prompts, "prompts")
    check_writable_file("--output", args.output)
    context = target_context(args.target) if args.regenerate else None
    if context is not None and args.max_new_tokens >= context:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens}: the target's context is {context} tokens, prompt "
                       "included")
    check_and_record(args.output, _data_settings(args))
    try:
        return _data_write(args, context)
    finally:
        if not os.path.exists(args.output) and os.path.exists(settings_path(args.output)):
            os.remove(settings_path(args.output))  # failed before its first record: no settings of no output


def _data_write(args: argparse.Namespace, context: int | None) -> int:
    import torch

    from .training.chat import ChatFormat, resolve_template
    from .training.data import HFGenerator, SGLangGenerator, eos_ids_of, regenerate, tokenize_conversations

    tokenizer = load_tokenizer(args.tokenizer, args.target)
    if not args.regenerate:
        if tokenizer is None:
            raise CLIError(f"--target {args.target}: no tokenizer there (give --tokenizer)")
        chat = ChatFormat(resolve_template(tokenizer, args.chat_template), _thinking(args.thinking),
                          args.last_turn_only)
        stats = tokenize_conversations(args.prompts, args.output, tokenizer, chat, split=args.split, limit=args.limit,
                                       progress=not args.no_progress)
        print(json.dumps({"output": args.output, "regenerated": False, **stats}))
        return 0
    backend = args.backend
    if backend == "auto":
        backend = "sglang" if torch.cuda.is_available() else "hf"
    if backend == "hf":
        model = load_target(args.target, args.dtype, args.device)
        eos = eos_ids_of(tokenizer, model, args.eos_token_id)
        gen = HFGenerator(model, eos, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                          batch_size=args.hf_batch_size)
    else:
        from transformers import AutoConfig, GenerationConfig

        gc = ac = None  # the target's configs, read as the transformers backend's model carries them
        try:
            gc = GenerationConfig.from_pretrained(args.target)
        except OSError:
            pass
        try:
            ac = AutoConfig.from_pretrained(args.target)
        except (OSError, ValueError):
            pass
        eos = eos_ids_of(tokenizer, SimpleNamespace(generation_config=gc, config=ac), args.eos_token_id)
        kw: dict[str, Any] = {"tp_size": args.tp_size, "dp_size": args.dp_size}
        if args.mem_fraction_static:
            kw["mem_fraction_static"] = args.mem_fraction_static
        if args.dtype:
            kw["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
        gen = SGLangGenerator(args.target, eos, args.max_new_tokens, args.temperature, args.top_p, args.seed, **kw)
    try:
        stats = regenerate(args.prompts, args.output, gen, tokenizer, enable_thinking=_thinking(args.thinking),
                           system_prompt=args.system_prompt, split=args.split, limit=args.limit,
                           chat_template=args.chat_template,
                           max_prompt_len=args.max_prompt_len, batch_size=args.batch_size,
                           progress=not args.no_progress, max_seconds=args.max_seconds, context_len=context,
                           max_new_tokens=args.max_new_tokens)
    finally:
        gen.close()
    if stats.get("skipped_over_context"):
        print(f"sglang-dspine data: {stats['skipped_over_context']} prompts skipped: prompt + --max-new-tokens "
              f"({args.max_new_tokens}) over the target's context of {context} tokens", file=sys.stderr)
    print(json.dumps({"output": args.output, "backend": backend, **stats}))
    return 0


# --------------------------------------------------------------------------------------------- train
_BOOL_SWITCHES = {"backbone_loss", "refinement_loss", "alignment_loss", "replacement"}


def _train_args(p: argparse.ArgumentParser) -> None:
    from .drafter.config import DSpineSettings
    from .training.train_config import ALIGNMENT_DECAYS, DEFAULT_RECIPE, RECIPES, TrainConfig

    d = TrainConfig()
    p.add_argument("--target", type=_path, required=True,
                   help="target model directory (transformers), or a hub repo id")
    p.add_argument("--data", type=_path, required=True,
                   help="JSONL of token records (`sglang-dspine data`) or conversations (`id` + `conversations`, "
                        "SpecForge's format: role/content or from/value), or both")
    p.add_argument("--output-dir", type=_path, required=True,
                   help="checkpoints, metrics.jsonl, tensorboard/ and final/ go here; a folder holding an "
                        "unfinished run (stopped by Ctrl-C, SIGTERM or a crash) resumes it with the same settings "
                        "(another setting is refused by name); one holding a finished run is refused without "
                        "--resume or --overwrite")
    p.add_argument("--kind", choices=["dspine", "dflash"], default="dspine")
    p.add_argument("--init", type=_path,
                   help="start from a drafter checkpoint (a DFlash one becomes a DSpine warm start)")
    g = p.add_argument_group("conversations (records with `conversations` or `messages`)")
    g.add_argument("--tokenizer", type=_path, help="tokenizer path (default: the target's)")
    _add_chat_args(g)
    g.add_argument("--last-turn-only", action="store_true",
                   help="loss on the last assistant turn only (default: on every assistant turn)")
    g = p.add_argument_group("fresh drafter (defaults fit the target)")
    g.add_argument("--num-draft-layers", type=int, help="default: 5, at most half the target's layers")
    g.add_argument("--block-size", type=int, default=d.block_size, help="block size B: tokens drafted per round")
    g.add_argument("--target-layer-ids", type=_int_list,
                   help="comma-separated (default: DFlash's spread over the target's layers, one per drafter layer)")
    g.add_argument("--mask-token-id", type=int,
                   help="default: the tokenizer's mask token, else <|MASK|>'s id (len(tokenizer) where it is not "
                        "in the vocabulary yet, as SpecForge: 151669 for Qwen3)")
    g = p.add_argument_group("DSpine settings (dspine_config; default: the recipe's, the reference's with "
                             "transfer rank hidden/4 capped at 1024 and message size half of it; a DSpine --init "
                             "keeps its own unless --recipe or a flag is given)")
    g.add_argument("--recipe", choices=sorted(RECIPES),
                   help=f"how a DSpine drafter is trained (default: {DEFAULT_RECIPE}): ce_anneal = CE on the "
                        "true next token for the backbone and the refinement, the alignment term faded out by a "
                        "cosine over the run (chosen on the lab's validation prompts); ce = the same with the "
                        "alignment constant; specforge = SpecForge's reference values exactly (0.1 CE + 0.9 L1 "
                        "to the target's distribution); any DSpine flag below overrides the recipe's value")
    for f in fields(DSpineSettings):
        # default None: an absent flag leaves the value to the recipe (or to a DSpine --init)
        g.add_argument(f"--{f.name.replace('_', '-')}", dest=f"dspine_{f.name}", metavar=f.name.upper(),
                       type=int if f.type in (int, "int") else float, default=None, help=_recipe_default(f.name))
    g = p.add_argument_group("objective")
    g.add_argument("--num-anchors", type=int, default=d.num_anchors, help="blocks per sequence")
    g.add_argument("--gamma", type=float, help="position decay γ (default: 7 for B=16, scaled with B as DFlash)")
    for name in sorted(_BOOL_SWITCHES):
        g.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_false",
                       help=f"switch off the {name.replace('_', ' ')} term")
    g.add_argument("--alignment-decay", choices=ALIGNMENT_DECAYS,
                   help="DSpine alignment term over the run: none (constant after its warm-up) or cosine (faded "
                        "to 0 as the learning rate) (default: the recipe's: cosine for ce_anneal, else none)")
    g.add_argument("--dflash-ce-weight", type=float, default=d.dflash_ce_weight,
                   help="DFlash objective: weight of CE against L1 to the teacher (1 = CE only)")
    g.add_argument("--freeze-backbone", action="store_true", help="train only the DSpine injection weights")
    g.add_argument("--objective-chunk-blocks", type=int, default=d.objective_chunk_blocks,
                   help="blocks per chunk of the vocabulary-sized loss work, recomputed in backward (bounds memory "
                        "at large vocabularies); 0: one chunk, much faster where memory allows (the lab's 8k "
                        "vocabulary: 4.9x per DSpine step on an H200, benchmarks/train_step.py)")
    g = p.add_argument_group("optimisation")
    helps = {"lr": "peak learning rate", "min_lr_ratio": "the cosine decay's last learning rate, a fraction of --lr",
             "warmup_ratio": "linear warm-up over this fraction of the steps", "init_std": "normal init of a fresh "
             "backbone's linear weights", "batch_size": "sequences per micro-batch per rank",
             "grad_accum": "micro-batches per optimizer step", "max_length": "tokens per sequence (longer ones are "
             "cut)", "log_every": "optimizer steps between metrics lines", "save_every": "also a checkpoint every this "
             "many optimizer steps (0: by --save-minutes only)", "save_minutes": "a checkpoint every this many "
             "minutes (0: off); Ctrl-C or SIGTERM also saves one, at the end of the step under way",
             "keep_checkpoints": "newest checkpoints kept in --output-dir (0: all)"}
    for name in ("lr", "min_lr_ratio", "warmup_ratio", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm",
                 "epochs", "init_std", "save_minutes"):
        g.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name), help=helps.get(name))
    for name in ("batch_size", "grad_accum", "max_length", "seed", "log_every", "save_every", "keep_checkpoints"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name), help=helps.get(name))
    g.add_argument("--max-steps", type=int,
                   help="stop after this many optimizer steps (default: none, --epochs decides; overrides --epochs)")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU")
    g.add_argument("--device", help="default: cuda:LOCAL_RANK if present, else cpu")
    g.add_argument("--resume", action="store_true",
                   help="--output-dir holds a finished run: check these are its settings and report it (nothing "
                        "to train); an unfinished run resumes without it")
    g.add_argument("--overwrite", action="store_true",
                   help="remove the run in --output-dir (checkpoints, final/, logs) and train a new one")
    g.add_argument("--no-save", dest="save", action="store_false",
                   help="metrics only: no checkpoint or final drafter (throughput trials)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g = p.add_argument_group("logging (metrics.jsonl always)")
    g.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                   help="no TensorBoard event files in --output-dir/tensorboard")
    g.add_argument("--wandb-project", help="also log to this Weights & Biases project (needs wandb installed)")
    g.add_argument("--run-name", help="the Weights & Biases run name")


def _recipe_default(name: str) -> str:
    """What a DSpine setting is when its flag is not given, by recipe."""
    from .drafter.config import DSpineSettings
    from .training.train_config import DEFAULT_RECIPE, RECIPES

    scaled = {"transfer_rank": "the target's hidden size / 4, at most 1024",
              "message_size": "the transfer rank / 2, at most 512"}
    if name in scaled:  # fitted to the target in every recipe (drafter.config.fresh_settings)
        return f"default: {scaled[name]}"
    value = {r: _shown(RECIPES[r].get(name, getattr(DSpineSettings, name))) for r in RECIPES}
    others = [f"{r}: {v}" for r, v in value.items() if r != DEFAULT_RECIPE and v != value[DEFAULT_RECIPE]]
    return f"default: {value[DEFAULT_RECIPE]}" + (f" (recipe {DEFAULT_RECIPE}; {'; '.join(others)})" if others else "")


def train_config_from_args(args: argparse.Namespace):
    from .drafter.config import DSpineSettings
    from .training.train_config import TrainConfig

    kw = {}
    for f in fields(TrainConfig):
        if f.name in ("dspine",):
            continue
        if hasattr(args, f.name):
            kw[f.name] = getattr(args, f.name)
    kw["dspine"] = {f.name: getattr(args, f"dspine_{f.name}") for f in fields(DSpineSettings)
                    if getattr(args, f"dspine_{f.name}", None) is not None}
    kw["enable_thinking"] = _thinking(args.thinking)
    tc = TrainConfig(**kw)
    try:
        tc.validate()
    except ValueError as e:
        raise CLIError(str(e)) from e
    return tc


def _train_run(args: argparse.Namespace) -> int:
    from .training.distributed import train_device
    from .training.interrupt import Interrupted, sigterm_as_keyboard_interrupt
    from .training.run_folder import check_rerun, clear_run
    from .training.trainer import train

    tc = train_config_from_args(args)
    if args.resume and args.overwrite:
        raise CLIError("--resume and --overwrite: give one (continue the run in --output-dir, or replace it)")
    _check_train_inputs(args, tc)
    state = check_rerun(tc, args.resume, args.overwrite)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if state == "finished":
        final = os.path.join(tc.output_dir, "final")
        print(f"sglang-dspine train: {tc.output_dir} holds this run, finished: nothing to train (its drafter: "
              f"{final})", file=sys.stderr)
        return 0
    check_writable_dir("--output-dir", tc.output_dir)
    tc.resume = state == "resume"
    with sigterm_as_keyboard_interrupt():
        try:
            device, bf16 = train_device(tc)
            target = load_target(args.target, "bf16" if bf16 else "fp32", str(device))
            if state == "overwrite" and rank0:
                clear_run(tc.output_dir)
            summary = train(tc, target=target)
        except Interrupted as e:
            if rank0:
                saved = (f"saved {e.checkpoint}; to resume, run the same command again" if e.checkpoint else
                         "nothing saved (--no-save)")
                print(f"sglang-dspine train: interrupted at step {e.step} of {e.total}: {saved}", file=sys.stderr)
            return 130
        except KeyboardInterrupt:  # before the loop, or a second signal: no checkpoint of this moment
            if rank0:
                print(f"sglang-dspine train: interrupted before a checkpoint of this moment; the same command resumes "
                      f"from the newest one in {tc.output_dir}, if any", file=sys.stderr)
            return 130
    if rank0:
        print(json.dumps(summary))
    return 0


def _check_train_inputs(args: argparse.Namespace, tc) -> None:
    """Every input of `train` that can be checked before the target loads."""
    from .drafter.checkpoint import check_drafter_dir

    if not os.path.isfile(tc.data):
        raise CLIError(f"--data {tc.data}: not found (a conversation JSONL, or token data from `sglang-dspine data`)")
    check_records("--data", tc.data, "training records")
    if tc.init:
        if not os.path.isfile(os.path.join(tc.init, "config.json")):
            raise CLIError(f"--init {tc.init}: no config.json there")
        check_drafter_dir(tc.init)  # before the target is loaded
    check_model_dir("--target", args.target)
    if tc.tokenizer:  # a bad one is refused before the target loads (the trainer loads it again)
        load_tokenizer(tc.tokenizer, None)
    if tc.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise CLIError("--wandb-project: the `wandb` package is not installed (pip install wandb)") from None


# -------------------------------------------------------------------------------------------- export
def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=_path, required=True,
                   help="a drafter directory, or a training --output-dir (its latest checkpoint)")
    p.add_argument("--output", type=_path, required=True, help="directory to write the serving checkpoint to")
    p.add_argument("--layout", choices=["specforge", "release"], default="specforge",
                   help="specforge: codes inside model.safetensors; release: codes in transfer.safetensors")
    p.add_argument("--dtype", default="bf16", help="tensor dtype of the export (bf16, fp16, fp32)")
    p.add_argument("--target", type=_path, help="check the drafter against this target (hidden size, vocab, layers)")
    p.add_argument("--force", action="store_true", help="overwrite an existing export")


def _export_run(args: argparse.Namespace) -> int:
    from .drafter.checkpoint import load_drafter, save_drafter
    from .drafter.config import DrafterConfigError
    from .training.trainer import resolve_checkpoint

    try:
        src = resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as e:
        raise CLIError(f"--checkpoint {e}") from None
    if os.path.isfile(os.path.join(args.output, "config.json")) and not args.force:
        raise CLIError(f"--output {args.output}: a checkpoint is already there (use --force to overwrite)")
    dtype_of(args.dtype)  # a bad --dtype before anything loads
    check_writable_dir("--output", args.output)
    if args.target:
        check_model_dir("--target", args.target)
    model = load_drafter(src)
    if args.target:
        from transformers import AutoConfig

        try:
            t = AutoConfig.from_pretrained(args.target)
        except (OSError, ValueError) as e:
            raise CLIError(f"--target {args.target}: cannot read a transformers config ({e})") from None
        t = getattr(t, "text_config", None) or t
        try:
            model.cfg.check_target(t.hidden_size, t.vocab_size, t.num_hidden_layers)
        except DrafterConfigError as e:
            raise CLIError(str(e)) from e
    dt = dtype_of(args.dtype)
    codes = model.transfer_codes.clone() if model.cfg.is_dspine else None
    model = model.to(dt)
    if codes is not None:  # the codes stay float32: they are fixed data, not weights
        model.transfer_codes = codes
    save_drafter(model, args.output, layout=args.layout)  # records the weights' dtype in config.json
    readable_by_all(args.output)
    print(json.dumps({"source": src, "output": args.output, "layout": args.layout,
                      "dtype": str(dt).removeprefix("torch."),
                      "kind": model.cfg.kind}))
    return 0


def _pair_and_prompts(args: argparse.Namespace, as_dspine: bool = False, check=None):
    """(drafter folder, target, drafter, EOS ids, [(id, prompt ids)]) for `eval` and `tree-calibrate`: the drafter
    and the prompts file checked (and `check(folder, config)`) before the target is loaded."""
    from .drafter.checkpoint import check_drafter_dir, load_drafter
    from .training.data import eos_ids_of, iter_records, prompt_ids
    from .training.trainer import resolve_checkpoint

    try:
        src = resolve_checkpoint(args.drafter)
    except FileNotFoundError as e:
        raise CLIError(f"--drafter {e}") from None
    cfg = check_drafter_dir(src)  # before the target is loaded
    check_records("--prompts", args.prompts, "prompts")
    if check is not None:
        check(src, cfg)
    tokenizer = load_tokenizer(args.tokenizer, args.target)  # before the target: a bad --tokenizer fails fast
    dev = default_device(args.device)
    target = load_target(args.target, args.dtype, dev)
    head = target.get_output_embeddings().weight
    drafter = load_drafter(src, as_dspine=as_dspine, target_head=head.detach().float().cpu(),
                           dtype=head.dtype, device=dev)
    drafter.cfg.check_target(head.shape[1], head.shape[0], target.config.num_hidden_layers)
    eos = eos_ids_of(tokenizer, target, args.eos_token_id)
    prompts = []
    for i, (rid, rec) in enumerate(iter_records(args.prompts, args.split)):
        if args.limit is not None and i >= args.limit:
            break
        prompts.append((rid, prompt_ids(rec, tokenizer, _thinking(args.thinking), args.system_prompt,
                                        where=f"{args.prompts} id {rid}", chat_template=args.chat_template)))
    if not prompts:
        raise CLIError(f"--prompts {args.prompts}: no prompts")
    return src, target, drafter, eos, prompts


# ------------------------------------------------------------------------------------- tree-calibrate
def _tree_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=_path, required=True,
                   help="target model directory (transformers), or a hub repo id")
    p.add_argument("--drafter", type=_path, required=True,
                   help="the DSpine drafter folder a server loads; the calibration is written into it")
    p.add_argument("--prompts", type=_path, required=True,
                   help="JSONL with `prompt`/`messages`/`prompt_ids` (or regenerated data: input_ids + prompt_len); "
                        "prompts like the ones served, not those you evaluate on")
    _add_prompt_args(p)
    p.add_argument("--max-new-tokens", type=_COUNT, default=64,
                   help="tokens of the target's greedy continuation per prompt, read teacher-forced")
    p.add_argument("--stride", type=_COUNT, default=4, help="draft a block at every STRIDE-th position of them")
    p.add_argument("--eos-token-id", type=_int_list, default=[], help="extra end tokens, comma-separated")
    p.add_argument("--dtype", help="target and drafter dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", help="default: cuda if present, else cpu")
    p.add_argument("--output", type=_path,
                   help="write the file here instead of into --drafter (a server reads it only from there)")


def _tree_calibrate_run(args: argparse.Namespace) -> int:
    import datetime

    import torch

    from .drafter.tree_calibration import FILE_NAME, TreeCalibration
    from .provenance import git_commit
    from .training.tree_generate import calibration_set, fit_depth_calibration

    def dspine_only(src, cfg):
        if not cfg.is_dspine:
            raise CLIError(f"--drafter {src} is a {cfg.kind} drafter; trees over the lattice need a DSpine drafter")
        if args.output:
            check_writable_file("--output", args.output)
        else:
            check_writable_file("--drafter", os.path.join(src, FILE_NAME))

    src, target, drafter, eos, prompts = _pair_and_prompts(args, check=dspine_only)
    from tqdm import tqdm

    with torch.no_grad():
        bar = tqdm([ids for _, ids in prompts], desc="tree-calibrate", unit="prompt", file=sys.stderr)
        cal = calibration_set(target, drafter, bar, args.max_new_tokens, 0.0, stride=args.stride,
                              eos_token_ids=set(eos))
        if cal.row_reached is None or not bool(cal.row_reached.any()):
            raise CLIError(f"--prompts {args.prompts}: no table row a tree can reach in the target's continuations "
                           "(more prompts, or a longer --max-new-tokens)")
        temps, log_mass = fit_depth_calibration(cal, drafter.cfg.block_size - 1)
    fitted = {"target": args.target, "prompts": args.prompts, "num_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "stride": args.stride, "table_rows": int(len(cal.rows)),
              "reachable_rows": int(cal.row_reached.sum()), "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    calibration = TreeCalibration(drafter.cfg.block_size, [float(t) for t in temps],
                                  [round(float(m), 6) for m in log_mass], fitted)
    written = args.output or os.path.join(src, FILE_NAME)
    os.makedirs(os.path.dirname(os.path.abspath(written)), exist_ok=True)
    calibration.save(written)
    print(json.dumps({"written": written, "block_size": calibration.block_size,
                      "temperature": calibration.temperature, "log_mass": calibration.log_mass, **fitted}))
    return 0


# ---------------------------------------------------------------------------------------------- eval
def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=_path, required=True,
                   help="target model directory (transformers), or a hub repo id")
    p.add_argument("--drafter", type=_path, required=True, help="drafter checkpoint (or a training --output-dir)")
    p.add_argument("--prompts", type=_path, required=True,
                   help="JSONL with `prompt`/`messages`/`prompt_ids` (or regenerated data: input_ids + prompt_len)")
    _add_prompt_args(p)
    p.add_argument("--as-dspine", action="store_true", help="evaluate a DFlash checkpoint as a DSpine warm start")
    p.add_argument("--decoding", choices=("walk", "argmax"), default="walk",
                   help="how a DSpine drafter picks its block: its transition-table walk (what it serves), or "
                        "the backbone's argmax at every position (an ablation of the walk; DFlash always argmax)")
    p.add_argument("--max-new-tokens", type=_COUNT, default=256)
    p.add_argument("--temperature", type=_NON_NEGATIVE, default=0.0)
    p.add_argument("--eos-token-id", type=_int_list, default=[], help="extra end tokens, comma-separated")
    p.add_argument("--check-greedy", action="store_true",
                   help="at temperature 0, also generate with the target alone and report exact matches")
    p.add_argument("--dtype", help="target and drafter dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", help="default: cuda if present, else cpu")
    p.add_argument("--seed", type=_SEED, default=0)
    p.add_argument("--output", type=_path, help="write the JSON result here (always printed too)")


def _eval_run(args: argparse.Namespace) -> int:
    from .training.data import HFGenerator
    from .training.generate import evaluate

    def refuse_argmax(src, cfg):
        if args.decoding == "argmax" and not (cfg.is_dspine or args.as_dspine):
            raise CLIError(f"--decoding argmax: drafter {src} is a DFlash drafter, which always drafts the argmax "
                           "(the walk-off ablation is for DSpine drafters)")

    def checks(src, cfg):
        refuse_argmax(src, cfg)
        if args.output:
            check_writable_file("--output", args.output)

    src, target, drafter, eos, prompts = _pair_and_prompts(args, args.as_dspine, checks)
    check = args.check_greedy and args.temperature == 0
    ref = HFGenerator(target, eos, args.max_new_tokens) if check else None
    res = evaluate(target, drafter, prompts, args.max_new_tokens, args.temperature, eos, args.decoding, args.seed,
                   reference=ref)
    out: dict[str, Any] = {**res, "drafter": src, "target": args.target}
    text = json.dumps(out, indent=2)
    print(text, flush=True)  # first: a file that fails to write below must not lose the result
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise CLIError(f"--output {args.output}: cannot write ({e.strerror or e}); the result is on standard "
                           "output") from None
    return 0 if not check or out["all_match_target"] else 1


register_command("data", "regenerate responses with the target into a JSONL of token ids + loss masks",
                 _data_args, _data_run)
register_command("train", "train a DSpine or DFlash drafter (torchrun for several GPUs)", _train_args, _train_run)
register_command("export", "write the serving checkpoint of a trained drafter", _export_args, _export_run)
register_command("eval", "offline acceptance length τ of a drafter with the target (JSON; τ = tokens ÷ verify "
                 "rounds over all prompts)", _eval_args, _eval_run)
register_command("tree-calibrate", "fit a DSpine drafter's tree calibration for greedy requests (what a server "
                 "verifying trees wider than the block reads; docs/tree.md)", _tree_calibrate_args,
                 _tree_calibrate_run)


# ---------------------------------------------------------------------------------------------- main
def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append `(default: VALUE)` to every option whose help does not say it already. Switches (the flag's
    presence is its meaning) and None defaults (their help says what happens) are left as written."""
    for action in parser._actions:
        v = action.default
        if action.required or v is None or isinstance(v, bool) or v == [] or v is argparse.SUPPRESS:
            continue
        shown = ",".join(map(str, v)) if isinstance(v, list) else _shown(v)
        text = action.help or ""
        if f"default: {shown}" not in text:
            # argparse %-formats help strings
            action.help = f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sglang-dspine", description="DSpine drafters: data, training, export, eval")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        show_defaults(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .drafter.config import DrafterConfigError
    from .training.data import DataError

    try:
        rc = args._run(args)
    except (CLIError, DrafterConfigError, DataError) as e:
        msg = " ".join(str(e).split())  # one line, whatever the message quotes
        print(f"sglang-dspine {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
