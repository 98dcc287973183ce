"""Lab stage 2b: a Qwen3-architecture target trained from scratch on the lab corpus.

transformers `Qwen3ForCausalLM` (SDPA attention), packed sequences (documents joined by `<|endoftext|>` into
one token stream, random windows of `--seq-len`), AdamW (fused on a GPU), bf16 autocast on a GPU and float32
on CPU, linear warm-up then cosine decay over the budget: `--seconds` of training time (the schedule follows
elapsed time) or `--steps`. Reports the held-out loss per domain (code, prose, math) on fixed windows of the
held-out splits. Saves an HF model directory SGLang can serve: config.json (Qwen3ForCausalLM, bf16,
`tie_word_embeddings: false`, bos/eos/pad ids), model.safetensors (bf16), generation_config.json, the
tokenizer files, and `lab_target.json` (the summary).

    python benchmarks/lab/target.py --corpus lab_out/corpus --tokenizer lab_out/tokenizer --out lab_out/target \
        --seconds 420            # the default size; ≤ 8 minutes on one H200
    python benchmarks/lab/target.py ... --tiny   # a CPU-sized model for tests
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from typing import Any

import numpy as np

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

# Sizes. The default trains in ≤ 8 minutes on one H200 and stays small enough (≈ 31 MB in bf16) to be kept.
DEFAULT = dict(hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64, intermediate=1024, seq_len=1024,
               batch_size=64, lr=2e-3, seconds=420.0, eval_tokens=262144)
TINY = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=192, seq_len=128,
            batch_size=16, lr=3e-3, seconds=12.0, eval_tokens=8192)


def _tok_module():
    """benchmarks.lab.tokenizer (the same module run.py uses when it runs in process)."""
    from benchmarks.lab import tokenizer

    return tokenizer


# ------------------------------------------------------------------------------------------- tokens
def encode_corpus(corpus: str, tokenizer_dir: str, cache: str, seed: int = 0, log=print) -> dict[str, Any]:
    """Token streams (uint16/int32 .npy): train (all domains, documents shuffled) and heldout.<domain>."""
    lab_tok = _tok_module()
    from tokenizers import Tokenizer

    meta_path = os.path.join(cache, "tokens.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            return json.load(f)
    t0 = time.time()
    os.makedirs(cache, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eot = tok.token_to_id(lab_tok.EOT)
    dtype = np.uint16 if tok.get_vocab_size() <= 65535 else np.int32

    batch_encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.21)

    def encode(texts: list[str]) -> np.ndarray:
        parts = []
        for i in range(0, len(texts), 2048):
            for enc in batch_encode(texts[i:i + 2048], add_special_tokens=False):
                parts.append(np.asarray(enc.ids + [eot], dtype=dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    meta: dict[str, Any] = {"dtype": np.dtype(dtype).name, "eot": eot, "streams": {}}
    train_docs = [t for _, t in lab_tok.iter_corpus(corpus, "train")]
    random.Random(seed).shuffle(train_docs)
    streams = {"train": train_docs}
    for d in lab_tok.DOMAINS:
        streams[f"heldout.{d}"] = [t for _, t in lab_tok.iter_corpus(corpus, "heldout", [d])]
    for name, docs in streams.items():
        arr = encode(docs)
        np.save(os.path.join(cache, f"{name}.npy"), arr)
        meta["streams"][name] = {"tokens": int(arr.size), "documents": len(docs)}
    meta["seconds"] = round(time.time() - t0, 2)
    write_json(meta_path, meta, indent=2)
    log(f"target: tokenized corpus in {meta['seconds']} s: " +
        ", ".join(f"{k} {v['tokens']:,}" for k, v in meta["streams"].items()))
    return meta


# -------------------------------------------------------------------------------------------- model
def make_config(dims: dict[str, Any], vocab_size: int, ids: dict[str, int] | None = None):
    """The target's Qwen3Config from the size keys of DEFAULT/TINY; `ids` (tokenizer.special_ids) sets
    bos/eos/pad (benchmarks/train_step.py builds random targets of these sizes without them)."""
    from transformers import Qwen3Config

    special = {} if ids is None else dict(bos_token_id=ids["endoftext"], eos_token_id=[ids["im_end"], ids["endoftext"]],
                                          pad_token_id=ids["endoftext"])
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=dims["hidden"], intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"],
        head_dim=dims["head_dim"], max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.02, attention_dropout=0.0, use_cache=True, **special,
    )


def lr_at(frac: float, warmup: float, min_ratio: float = 0.1) -> float:
    if frac < warmup:
        return (frac + 1e-9) / warmup
    p = min(max((frac - warmup) / max(1 - warmup, 1e-9), 0.0), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def windows(stream, starts, seq_len: int):
    import torch

    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1, device=stream.device)
    return stream[idx].long()


def heldout_loss(model, streams: dict[str, Any], seq_len: int, eval_tokens: int, batch: int, device,
                 bf16: bool) -> dict[str, float]:
    """Mean next-token loss on evenly spaced windows of each held-out stream (deterministic)."""
    import torch
    import torch.nn.functional as F

    out = {}
    model.eval()
    for name, stream in streams.items():
        n_win = max(1, min(eval_tokens // seq_len, (stream.numel() - 1) // seq_len))
        if stream.numel() < seq_len + 2:
            continue
        starts = torch.linspace(0, stream.numel() - seq_len - 2, n_win, device=device).long()
        tot, cnt = 0.0, 0
        with torch.no_grad():
            for i in range(0, n_win, batch):
                w = windows(stream, starts[i:i + batch], seq_len)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(input_ids=w[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
                tot += float(loss)
                cnt += w[:, 1:].numel()
        out[name.split(".", 1)[1]] = tot / max(cnt, 1)
    model.train()
    if out:
        out["mean"] = sum(out.values()) / len(out)
    return out


def train(args) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    t_start = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bf16 = device.type == "cuda" and not args.fp32
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cache = args.token_cache or os.path.join(os.path.dirname(os.path.abspath(args.out)), "tokens")
    meta = encode_corpus(args.corpus, args.tokenizer, cache, args.seed)
    dt = np.dtype(meta["dtype"])

    def load(name):
        arr = np.load(os.path.join(cache, f"{name}.npy")).astype(np.int32 if dt == np.uint16 else dt)
        return torch.from_numpy(arr).to(device)

    train_stream = load("train")
    held = {n: load(n) for n in meta["streams"] if n.startswith("heldout.")}
    if train_stream.numel() < args.seq_len + 2:
        raise SystemExit(f"target: the train stream has {train_stream.numel()} tokens; "
                         f"need more than --seq-len {args.seq_len}")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = _tok_module().special_ids(tokenizer)
    config = make_config(vars(args), len(tokenizer), ids)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    step_fn = model
    if args.compile:
        step_fn = torch.compile(model)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gen = torch.Generator(device=device).manual_seed(args.seed)
    hi = train_stream.numel() - args.seq_len - 1
    budget_s = None if args.steps else float(args.seconds)
    print(f"target: {n_params / 1e6:.2f}M parameters on {device} ({'bf16 autocast' if bf16 else 'fp32'}), "
          f"{train_stream.numel():,} train tokens, budget {f'{budget_s:.0f} s' if budget_s else f'{args.steps} steps'}",
          flush=True)
    model.train()
    step, tokens, t0 = 0, 0, time.time()
    last_log = t0
    history = []
    while True:
        elapsed = time.time() - t0
        frac = step / args.steps if args.steps else elapsed / budget_s
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_at(frac, args.warmup)
        starts = torch.randint(0, hi, (args.batch_size,), device=device, generator=gen)
        w = windows(train_stream, starts, args.seq_len)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = step_fn(input_ids=w[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += w[:, 1:].numel()
        if step % args.log_every == 0:  # the loss of this step only (reading it syncs the GPU)
            now = time.time()
            if not math.isfinite(float(loss.detach())):  # diverged: stop now rather than save a broken target
                raise SystemExit(f"target: the training loss is {float(loss.detach())} at step {step} (learning "
                                 f"rate {opt.param_groups[0]['lr']:.3g} of --lr {args.lr:g}); nothing saved; lower "
                                 "--lr")
            rec = {"step": step, "loss": round(float(loss.detach()), 4), "lr": opt.param_groups[0]["lr"],
                   "tokens": tokens, "tokens_per_s": round(tokens / max(now - t0, 1e-9)), "elapsed": round(now - t0, 1)}
            history.append(rec)
            if now - last_log >= args.print_every:
                print("target: " + json.dumps(rec), flush=True)
                last_log = now
    train_s = time.time() - t0
    final_train_loss = float(loss.detach()) if step else float("nan")
    hl = heldout_loss(model, held, args.seq_len, args.eval_tokens, args.batch_size, device, bf16)
    # save: bf16 weights, tokenizer, generation config
    os.makedirs(args.out, exist_ok=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    GenerationConfig(bos_token_id=ids["endoftext"], eos_token_id=[ids["im_end"], ids["endoftext"]],
                     pad_token_id=ids["endoftext"], do_sample=False).save_pretrained(args.out)
    summary = {
        "parameters": n_params, "config": {k: getattr(args, k) for k in DEFAULT}, "steps": step, "tokens": tokens,
        "train_seconds": round(train_s, 1), "tokens_per_s": round(tokens / max(train_s, 1e-9)),
        "train_loss_last": round(final_train_loss, 4), "heldout_loss": {k: round(v, 4) for k, v in hl.items()},
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "precision": "bf16-autocast" if bf16 else "fp32", "compile": bool(args.compile),
        "corpus_tokens": meta["streams"], "total_seconds": round(time.time() - t_start, 1),
        "size_mb_bf16": round(os.path.getsize(os.path.join(args.out, "model.safetensors")) / 1e6, 2),
        "history": history[-50:],
    }
    write_json(os.path.join(args.out, "lab_target.json"), summary, indent=2)
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--token-cache", help="where the tokenized corpus goes (default: OUT/../tokens)")
    p.add_argument("--tiny", action="store_true", help="CPU-test sizes (unset size flags take the tiny values)")
    for k, v in DEFAULT.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None, help=f"default {v} (tiny: {TINY[k]})")
    p.add_argument("--steps", type=int, help="train for this many steps instead of --seconds")
    p.add_argument("--warmup", type=float, default=0.03, help="warm-up share of the budget")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU; costs compile time)")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on a GPU")
    p.add_argument("--device")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--print-every", type=float, default=15.0, help="seconds between printed log lines")
    p.add_argument("--force", action="store_true")


def resolve_sizes(args) -> None:
    base = TINY if args.tiny else DEFAULT
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    resolve_sizes(args)
    marker = os.path.join(args.out, "lab_target.json")
    if os.path.isfile(marker) and not args.force:
        print(f"target: {marker} exists, skipped (--force retrains)")
        return 0
    if args.force and os.path.isdir(args.out):
        shutil.rmtree(args.out)
    import torch

    with torch.enable_grad():  # whatever the caller's mode (the lab runs stages in-process)
        s = train(args)
    print("target: " + json.dumps({k: s[k] for k in ("parameters", "steps", "tokens", "train_seconds", "tokens_per_s",
                                                     "train_loss_last", "heldout_loss", "size_mb_bf16")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
