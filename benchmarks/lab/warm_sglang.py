"""Warm SGLang's on-disk caches for a lab preset while its target still trains (GPU machine).

A fresh machine's first SGLang start builds JIT kernels (KV store, RoPE), compiles Triton kernels and, at the
first batch mixing greedy and T=1 requests, the sampling kernels: minutes that otherwise fall on the serving
stage. This starts the three servers the serving stage will start (target alone, DFLASH, DSPINE; with
serve_bench.py's flags) on models of the preset's exact shapes but random weights: the target as a
config-only folder served with `--load-format dummy`, the drafters freshly initialised by the package and
saved as the export writes them (loaded with `--speculative-draft-load-format safetensors`); sends each one
mixed burst; then makes one short bench_serving run on each through serve_bench.py (the lab's held-out suites
as its dataset, counters reset first), so the serving stage's own path has run once before it counts; stops
them. The caches (SGLang's, Triton's, under /tmp) stay for the real servers. Needs the lab's corpus and
tokenizer stages. `ok` in the JSON is true when every server started and every check run returned a result.

    python benchmarks/lab/warm_sglang.py --lab /tmp/lab2/lab --preset second --out /tmp/lab2/warm
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import time

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name: str):
    """A sibling module (run, ...) of the package benchmarks.lab."""
    return importlib.import_module(f"benchmarks.lab.{name}")


def build_models(lab: str, preset: str, out: str) -> dict[str, str]:
    """A config-only target of the preset's shape (with the lab's tokenizer) and random DFlash/DSpine drafters
    of its drafter shape, in serving format; returns their folders."""
    import torch
    from transformers import AutoTokenizer

    from sglang_dspine.cli import main as cli_main
    from sglang_dspine.drafter.checkpoint import init_dspine_transfer, save_drafter
    from sglang_dspine.drafter.config import default_target_layer_ids, new_drafter_config
    from sglang_dspine.drafter.model import DSpineDrafter
    from sglang_dspine.training.drafter_setup import init_backbone

    p = _sibling("run").PRESETS[preset]
    target_mod = _sibling("target")
    ap = argparse.ArgumentParser()
    target_mod.add_arguments(ap)
    targs = ap.parse_args(["--corpus", "-", "--tokenizer", "-", "--out", "-"] + list(p["target_args"]))
    target_mod.resolve_sizes(targs)
    tok_dir = os.path.join(lab, "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    ids = _sibling("tokenizer").special_ids(tokenizer)
    cfg = target_mod.make_config(vars(targs), len(tokenizer), ids)
    tdir = os.path.join(out, "target")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(tdir)
    cfg.architectures = ["Qwen3ForCausalLM"]
    d = cfg.to_dict()
    d["dtype"] = d["torch_dtype"] = "bfloat16"  # what the real target's folder says (saved in bf16)
    write_json(os.path.join(tdir, "config.json"), d, indent=2)
    tokenizer.save_pretrained(tdir)
    layers = int(p["draft_layers"])
    layer_ids = ([int(x) for x in str(p["target_layer_ids"]).split(",")] if p["target_layer_ids"]
                 else default_target_layer_ids(cfg.num_hidden_layers, layers))
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    dirs = {"target": tdir}
    for kind in ("dflash", "dspine"):
        model = DSpineDrafter(new_drafter_config(cfg, kind, layers, int(p["block_size"]), layer_ids, ids["mask"]))
        init_backbone(model, 0.02)
        if model.cfg.is_dspine:
            init_dspine_transfer(model, head)
        raw = os.path.join(out, f"{kind}_raw")
        save_drafter(model, raw)
        dirs[kind] = os.path.join(out, kind)
        if cli_main(["export", "--checkpoint", raw, "--output", dirs[kind], "--dtype", "bf16"]) != 0:
            raise SystemExit(f"warm_sglang: exporting the random {kind} drafter failed")
    return dirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", required=True, help="a lab --out folder whose tokenizer stage is done")
    ap.add_argument("--preset", default="second")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=420, help="seconds for the servers to come up")
    ap.add_argument("--build-only", action="store_true", help="write the models and stop (no GPU needed)")
    args = ap.parse_args(argv)
    t0 = time.time()
    dirs = build_models(args.lab, args.preset, args.out)
    res = {"models": dirs, "build_seconds": round(time.time() - t0, 1)}
    if args.build_only:
        print(json.dumps(res))
        return 0
    sb = _sibling("serve_bench")
    servers = {}
    for i, name in enumerate(sb.SERVERS):
        model = ["--model-path", dirs["target"], "--load-format", "dummy"]
        if name != "plain":
            model += ["--speculative-algorithm", name.upper(), "--speculative-draft-model-path", dirs[name],
                      "--speculative-draft-load-format", "safetensors"]
        servers[name] = sb.Server(f"warm_{name}", 31100 + i, model + sb.SERVER_ARGS, args.out)
    try:
        up = sb.wait_all(servers, args.timeout)
        res["startup_seconds"] = {n: s.up_after for n, s in servers.items()}
        live = {n: s for n, s in servers.items() if up[n]}
        texts = ["def add(a, b):", "The answer is", "Maya has 12 apples.", "Write a function."]
        res["burst_seconds"] = sb.warm_up_seconds(sb.start_warm_up(live, texts), wait=True)
        dataset = os.path.join(args.out, "bench_prompts.jsonl")
        sb.write_dataset(os.path.join(args.lab, "corpus", "prompts"), dataset)
        res["bench_check"] = {}
        for n, s in live.items():  # one at a time, as the serving stage measures
            check = sb.measure(s, sb.bench_argv(s.port, dirs["target"], dataset, 2, 0.0, 16,
                                                os.path.join(args.out, f"bench_{n}.jsonl")))
            res["bench_check"][n] = check
            print(f"warm_sglang: bench_serving check {n}: {check}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
        sb.archive_logs(args.out, "warm_server_logs.tar.gz")
    res["seconds"] = round(time.time() - t0, 1)
    checks = res.get("bench_check", {})
    res["ok"] = len(checks) == len(servers) and all(c.get("completed") for c in checks.values())
    write_json(os.path.join(args.out, "warm_sglang.json"), res)
    print("warm_sglang: " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
