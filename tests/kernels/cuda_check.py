"""The Triton kernels compiled for a real CUDA device against the torch references, at model
sizes (head_dim 128/256, contexts in the thousands, GQA 8, block sizes 16/32, split-K).
Run as a script with TRITON_INTERPRET=0 on a machine with CUDA; `test_kernels_cuda.py` does.
Exits 0 and prints one line per case when everything matches."""

from __future__ import annotations

import sys

import torch

from kernel_cases import TOLERANCE, assert_matches, make_case, poisoned_like, windowed
from tidal.kernels.attention.reference import paged_attention_ref, write_kv_ref
from tidal.kernels.attention.triton_attention import (
    AttentionLaunch,
    paged_attention_triton,
    run_paged_attention,
    write_kv_triton,
)

# (q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
CASES = [
    ([1] * 8, [1, 15, 16, 17, 300, 1024, 2500, 4096], 32, 8, 128, 16),  # ragged decode
    ([1, 1], [3000, 17], 32, 8, 128, 16),  # few long decodes: auto split-K
    ([300, 1, 77, 0, 1], [300, 900, 1100, 12, 5], 32, 8, 128, 32),  # mixed prefill/decode
    ([64, 1], [600, 333], 16, 4, 256, 16),
    ([5, 1, 1], [40, 2000, 9], 12, 12, 64, 16),
]


def to_cuda(case):
    for name in ("query", "key_cache", "value_cache", "block_tables", "query_start_loc",
                 "seq_lens"):
        setattr(case, name, getattr(case, name).cuda())
    return case


def check_attention(case, dtype, launch=None, **window_and_cap) -> None:
    cpu_args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in case.args()]
    expected = paged_attention_ref(*cpu_args, out=poisoned_like(cpu_args[0]), **window_and_cap)
    out = poisoned_like(case.query)
    if launch is None:
        paged_attention_triton(*case.args(), out=out, **window_and_cap)
    else:
        run_paged_attention(*case.args(), out, launch, **window_and_cap)
    torch.cuda.synchronize()
    assert_matches(out.cpu(), expected, case.owned_rows())


def check_write_kv(dtype) -> None:
    key = torch.randn(300, 8, 128, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    caches = [torch.full((64, 16, 8, 128), float("nan"), dtype=dtype, device="cuda")
              for _ in range(4)]
    write_kv_ref(key, value, caches[0], caches[1], slots)
    write_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(), caches[2].nan_to_num())
    assert torch.equal(caches[1].nan_to_num(), caches[3].nan_to_num())


def main() -> int:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_write_kv(dtype)
        for i, (q_lens, seq_lens, heads, kv_heads, head_dim, block_size) in enumerate(CASES):
            case = to_cuda(make_case(q_lens, seq_lens, heads, kv_heads, head_dim, block_size,
                                     dtype, seed=i, num_pad_tokens=3))
            check_attention(case, dtype)
            if all(q == 1 for q in q_lens):
                check_attention(case, dtype, AttentionLaunch(16, 64, num_splits=7))
            # a sliding window (Mistral's, Gemma's sliding layers) with Gemma 2's score cap;
            # the blocks before each request's window poisoned, as once freed
            windowed(case, 257)
            check_attention(case, dtype, sliding_window=257, soft_cap=50.0)
            if all(q == 1 for q in q_lens):
                check_attention(case, dtype, AttentionLaunch(16, 64, num_splits=7),
                                sliding_window=257)
            print(f"ok {dtype} case {i} (tolerance {TOLERANCE[dtype]})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
