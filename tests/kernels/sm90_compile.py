"""Compile the attention kernels for an H100 (sm_90) without a GPU and report what the machine
code looks like: registers, spill stack, shared memory, whether K/V loads became 16-byte
asynchronous copies. Run as a script (TRITON_INTERPRET must be unset: interpreted kernels
cannot be compiled); prints one JSON object per kernel configuration.

    python tests/kernels/sm90_compile.py

Arguments are specialised the way the Triton runtime does for real model shapes: pointers and
strides divisible by 16, head-dim strides equal to 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tidal.kernels.attention import triton_attention as ta

TARGET = GPUTarget("cuda", 90, 32)
TL_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}
# (name, dtype, num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, max_kv_len, sms)
CONFIGS = [
    ("decode-gqa8-d128", torch.bfloat16, 64, 64, 32, 8, 128, 4096, 132),
    ("decode-splitk-d128", torch.bfloat16, 2, 2, 32, 8, 128, 32768, 132),
    ("prefill-gqa8-d128", torch.bfloat16, 2048, 1, 32, 8, 128, 4096, 132),
    ("decode-mha-d64", torch.float16, 64, 64, 16, 16, 64, 4096, 132),
    ("prefill-gqa4-d256", torch.bfloat16, 2048, 1, 16, 4, 256, 4096, 132),
]


def _signature(kernel, ptr_types: dict, constants: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            sig[name] = "constexpr"
            continue
        sig[name] = ptr_types.get(name, "i32")
        divisible = name.endswith("_ptr") or (name.startswith("stride") and name != "stride_bt_seq")
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _resources(cubin: bytes) -> dict:
    bindir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return {key.lower(): int(val) for key, val in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def compile_attention(name, dtype, num_tokens, num_seqs, num_heads, num_kv_heads, head_dim,
                      max_kv_len, num_sms) -> dict:
    launch = ta.choose_launch(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim,
                              max_kv_len, num_sms, dtype)
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    constants = ta._kernel_constants(dtype, group, group_pad, launch.block_m // group_pad,
                                     head_dim, 16, launch)
    for stride in ("stride_q_dim", "stride_o_dim", "stride_kc_dim", "stride_vc_dim"):
        constants[stride] = 1
    t, acc = TL_NAMES[dtype], "fp64" if dtype == torch.float64 else "fp32"
    ptr_types = {
        "out_ptr": f"*{t}", "query_ptr": f"*{t}", "key_cache_ptr": f"*{t}",
        "value_cache_ptr": f"*{t}", "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
        "seq_lens_ptr": "*i32", "part_acc_ptr": f"*{acc}", "part_max_ptr": f"*{acc}",
        "part_sum_ptr": f"*{acc}", "scale_log2": "fp32",
    }
    kernel = ta._paged_attention_kernel
    sig, attrs = _signature(kernel, ptr_types, constants)
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constants,
                                        attrs=attrs), target=TARGET,
                              options={"num_warps": launch.num_warps,
                                       "num_stages": launch.num_stages})
    ptx = compiled.asm["ptx"]
    return dict(name=name, launch=vars(launch), **_resources(compiled.asm["cubin"]),
                dynamic_shared=compiled.metadata.shared,
                cp_async_16b=len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*0x10,", ptx)),
                scalar_b16_loads=ptx.count("ld.global.b16"))


def _compile(name, kernel, ptr_types, constants, num_warps, num_stages=1) -> dict:
    sig, attrs = _signature(kernel, ptr_types, constants)
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constants,
                                        attrs=attrs), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return dict(name=name, dynamic_shared=compiled.metadata.shared,
                **_resources(compiled.asm["cubin"]))


def compile_helpers() -> list[dict]:
    """The KV write (bf16, 8 heads x 128) and the split-K merge (32 splits x 128)."""
    write = _compile("write-kv-d128", ta._write_kv_kernel, {
        "key_ptr": "*bf16", "value_ptr": "*bf16", "key_cache_ptr": "*bf16",
        "value_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
        {"BLOCK_H": 8, "BLOCK_D": 128, "stride_k_dim": 1, "stride_v_dim": 1,
         "stride_kc_dim": 1, "stride_vc_dim": 1}, num_warps=4)
    merge = _compile("merge-splits-d128", ta._merge_splits_kernel, {
        "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
        "part_sum_ptr": "*fp32", "query_start_loc_ptr": "*i32"},
        {"NUM_SPLITS": 32, "SPLITS_PAD": 32, "HEAD_DIM": 128, "HEAD_PAD": 128,
         "stride_o_dim": 1}, num_warps=ta.merge_num_warps(32, 128))
    return [write, merge]


def main() -> None:
    if triton.knobs.runtime.interpret:
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    for config in CONFIGS:
        print(json.dumps(compile_attention(*config)), flush=True)
    for report in compile_helpers():
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
