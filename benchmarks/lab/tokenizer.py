"""Lab stage 2a: a byte-level BPE tokenizer trained with `tokenizers` on the lab corpus.

Special tokens (ids 0..3, in this order): `<|endoftext|>` (document separator, padding, bos),
`<|im_start|>`, `<|im_end|>` (end of a chat turn: the end token of generation), `<|MASK|>` (the drafters'
mask token). The chat template is ChatML without a default system prompt:

    <|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n{content}<|im_end|>\n

Saved as a transformers `PreTrainedTokenizerFast` directory (tokenizer.json, tokenizer_config.json with the
chat template); nothing is added to encoded text automatically (no BOS).

    python benchmarks/lab/tokenizer.py --corpus lab_out/corpus --out lab_out/tokenizer --vocab-size 8192
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

EOT, IM_START, IM_END, MASK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END, MASK]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DOMAINS = ("code", "prose", "math")


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in Python (same text as `CHAT_TEMPLATE`; used to render the training corpus)."""
    out = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return out + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def record_text(rec: dict[str, Any]) -> str:
    """A corpus record as training text: plain text, or a chat pair rendered with the template."""
    if rec.get("messages") is not None:
        return render_chat(rec["messages"])
    return rec["text"]


def iter_corpus(corpus: str, split: str = "train", domains=DOMAINS) -> Iterator[tuple[str, str]]:
    """(domain, text) of every document of a split, domain by domain, in file order."""
    from sglang_dspine.training.jsonl import iter_jsonl

    for d in domains:
        path = os.path.join(corpus, f"{d}.{split}.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: not found (run the corpus stage first)")
        for _, rec in iter_jsonl(path):
            yield d, record_text(rec)


def sample_texts(corpus: str, sample_mb: float, seed: int = 0) -> list[str]:
    """Up to sample_mb of training documents, a fixed-seed sample spread over the domains."""
    texts = [t for _, t in iter_corpus(corpus, "train")]
    random.Random(seed).shuffle(texts)
    out, used, limit = [], 0, sample_mb * 1e6
    for t in texts:
        if used >= limit:
            break
        out.append(t)
        used += len(t)
    return out


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def to_transformers(tok):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=IM_END, pad_token=EOT,
                                   unk_token=None, mask_token=MASK, additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def special_ids(tokenizer) -> dict[str, int]:
    return {name: int(tokenizer.convert_tokens_to_ids(t)) for name, t in
            (("endoftext", EOT), ("im_start", IM_START), ("im_end", IM_END), ("mask", MASK))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="the corpus stage's output directory")
    p.add_argument("--out", required=True, help="tokenizer directory to write")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--sample-mb", type=float, default=40.0, help="train on at most this much text")
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    marker = os.path.join(args.out, "lab_tokenizer.json")  # written last: a tokenizer.json alone is an unfinished run
    if os.path.isfile(marker) and not args.force:
        print(f"tokenizer: {marker} exists, skipped (--force retrains)")
        return 0
    t0 = time.time()
    texts = sample_texts(args.corpus, args.sample_mb, args.seed)
    tok = train_tokenizer(texts, args.vocab_size, args.min_frequency)
    fast = to_transformers(tok)
    # a round trip over a few documents, mask token included
    for t in texts[:20] + [f"x = 1 {MASK} y{IM_END}\n"]:
        ids = fast(t, add_special_tokens=False)["input_ids"]
        if fast.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) != t:
            raise SystemExit("tokenizer: decode(encode(text)) != text; refusing to save")
    os.makedirs(args.out, exist_ok=True)
    fast.save_pretrained(args.out)
    sample = "".join(texts[:200])
    n_tok = len(tok.encode(sample).ids) if sample else 0
    summary = {"vocab_size": len(fast), "special": special_ids(fast),
               "trained_on_mb": round(sum(map(len, texts)) / 1e6, 2),
               "bytes_per_token": round(len(sample.encode()) / max(n_tok, 1), 3), "seconds": round(time.time() - t0, 2)}
    write_json(os.path.join(args.out, "lab_tokenizer.json"), summary, indent=2)
    print("tokenizer: " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
