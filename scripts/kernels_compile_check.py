"""Compile the DSpine Triton kernels for an H100/H200 (sm_90) on a machine without a GPU.

Catches what the interpreter cannot (type errors of the real code generator, tile constraints) and prints
ptxas's register / spill / shared-memory report for the Qwen3-8B configurations. No GPU, no device time.
Usage: python scripts/kernels_compile_check.py
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sglang_dspine.kernels.injection import _gate_message_kernel
from sglang_dspine.kernels.top_k import _group_max_kernel, _select_kernel
from sglang_dspine.kernels.transition import (
    _SCORE_CONFIGS,
    _finish_walk_kernel,
    _position_kernel,
    _score_kernel,
    _walk_kernel,
)

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_one(fn, sig: dict, consts: dict, num_warps: int, num_stages: int = 3) -> str:
    signature = {k: ("constexpr" if k in consts else v) for k, v in sig.items()}
    for k in consts:
        signature.setdefault(k, "constexpr")
    src = ASTSource(fn, signature, constexprs=consts)
    ck = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ck.asm["ptx"])
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    info = " ".join(re.findall(r"(Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads"
                               r"|\d+ bytes stack frame)",
                               out.stdout + out.stderr))
    smem = ck.metadata.shared
    return f"{info}, {smem} bytes shared" + ("  ** OVER the 232448-byte limit **" if smem > 232448 else "")


def main() -> None:
    bf = "*bf16"
    gate_sig = {n: bf for n in ["h_ptr", "z_ptr", "y_ptr", "ap_ptr", "b_ptr", "msg_ptr"]}
    gate_sig.update(recv_ptr="*fp32", stride_h="i32", stride_z="i32", stride_y="i32", stride_ap="i32",
                    stride_msg="i32", stride_recv="i32", sqrt_r="fp32", eps="fp32")
    for recv in (False, True):
        c = dict(B=16, H=4096, R=1024, M=512, BLOCK_H=4096, BLOCK_R=1024, BLOCK_M=512, WRITE_RECV=recv)
        print(f"gate_message  recv={recv}: ", compile_one(_gate_message_kernel, gate_sig, c, 4))

    s_sig = dict(pre_ptr=bf, recv_ptr="*fp32", uh_ptr=bf, cand_ptr="*i64", anc_ptr="*i64", pp_ptr=bf, hp_ptr=bf,
                 head_ptr=bf, w_ptr=bf, b_ptr=bf, rf_ptr=bf, s_ptr="*fp32", ch_ptr="*i64", tok_ptr="*i64")
    s_sig.update({k: "i32" for k in ["s_pre_n", "s_pre_p", "s_recv_n", "s_recv_p", "s_uh_n", "s_uh_p", "s_head",
                                      "s_pp", "s_hp"]})
    s_sig["norm_eps"] = "fp32"
    for pb in (1, 2, 4, 8, 16):
        for by_token in (True, False):
            for dt, dtn in ((tl.bfloat16, "bf16"), (tl.float32, "fp32")):
                if dtn == "fp32" and (pb not in (1, 16) or not by_token):
                    continue
                sig = dict(s_sig)
                if dtn == "fp32":
                    sig.update({k: "*fp32" for k in ["pre_ptr", "uh_ptr", "pp_ptr", "hp_ptr", "head_ptr", "w_ptr",
                                                      "b_ptr", "rf_ptr"]})
                bh, bm, bq, cw, nw = _SCORE_CONFIGS[pb]
                ns = 3
                if dtn == "fp32":
                    cw, ns = cw // 2, 1
                c = dict(P=15, K=16, KP=16, H=4096, M=512, PB=pb, BLOCK_H=bh, BLOCK_M=bm, BLOCK_Q=bq, CW=cw,
                         BY_TOKEN=by_token, FUSE_WALK=pb >= 15, DOT_DT=dt,
                         DOT_PREC="ieee" if dtn == "fp32" else "tf32")
                print(f"score PB={pb:2d} by_token={by_token!s:5} {dtn}: ", compile_one(_score_kernel, sig, c, nw, ns))
    for by_token in (True, False):
        for dtn in ("bf16", "fp32"):
            sig = {k: v for k, v in s_sig.items() if k not in ("rf_ptr", "s_ptr", "ch_ptr", "tok_ptr", "norm_eps")}
            if dtn == "fp32":
                sig.update({k: "*fp32" for k in ["pre_ptr", "uh_ptr", "pp_ptr", "hp_ptr", "head_ptr", "w_ptr",
                                                 "b_ptr"]})
            sig.update(msg_ptr="*" + dtn, num_ptr="*fp32", base_ptr="*fp32", rho_ptr="*fp32")
            c = dict(P=15, K=16, KP=16, H=4096, M=512, MB=512, MCH=512, BLOCK_H=512, BY_TOKEN=by_token,
                     DOT_DT=tl.float32 if dtn == "fp32" else tl.bfloat16, DOT_PREC="ieee" if dtn == "fp32" else "tf32")
            print(f"split position by_token={by_token!s:5} {dtn}: ", compile_one(_position_kernel, sig, c, 8))
    f_sig = dict(x_ptr=bf, num_ptr="*fp32", base_ptr="*fp32", rho_ptr="*fp32", cand_ptr="*i64", s_ptr="*fp32",
                 ch_ptr="*i64", tok_ptr="*i64", norm_eps="fp32")
    print("split finish+walk: ",
          compile_one(_finish_walk_kernel, f_sig, dict(P=15, K=16, KP=16, H=4096, M=512, MB=512), 8))
    w_sig = dict(s_ptr="*fp32", cand_ptr="*i64", ch_ptr="*i64", tok_ptr="*i64")
    print("walk: ", compile_one(_walk_kernel, w_sig, dict(P=15, K=16, KP=16), 1))
    g_sig = dict(x_ptr=bf, g_ptr="*fp32", V="i32", G="i32", stride_x="i32", stride_g="i32")
    print("topk group max: ", compile_one(_group_max_kernel, g_sig, dict(S=32, BLOCK_G=128), 4))
    sel_sig = dict(x_ptr=bf, g_ptr="*fp32", val_ptr=bf, idx_ptr="*i64", V="i32", G="i32", stride_x="i32",
                   stride_g="i32", stride_v="i32", stride_i="i32")
    print("topk select: ", compile_one(_select_kernel, sel_sig, dict(K=16, KP=16, S=32, BLOCK_G=8192), 8))


if __name__ == "__main__":
    main()
