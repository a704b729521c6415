"""The C attention kernel's AVX-512 code on a machine without AVX-512: decode_attention.c built
with `avx512_shim.h` (scalar stand-ins for its intrinsics, 16 lanes) and loaded in place of the
native build, then the cpu backend against the reference on the shapes that reach its blocked
prefill kernel (chunks of more than ROW_CHUNK_TOKENS new tokens), full attention and sliding
windows with soft caps. On an AVX-512 machine the native build runs these paths in
test_torch_attention.py and test_sliding_window.py already; elsewhere (the AVX2 CI machines)
only this test does."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernel_cases import assert_matches, make_case, poisoned_like, windowed
from tidal.kernels.attention import cpu_attention
from tidal.kernels.attention.cpu_attention import CpuBackend
from tidal.kernels.attention.metadata import AttentionMetadata
from tidal.kernels.attention.reference import paged_attention_ref

SHIM = Path(__file__).with_name("avx512_shim.h")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The kernel library built with the shim: AVX-512's code path, scalar arithmetic."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = cpu_attention.SOURCE.read_text()
    for native, stand_in in [
            ("#include <immintrin.h>", f'#include "{SHIM}"'),
            ("#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))", "#if 1"),
            ("#if defined(__AVX512F__)\n", "#if 1\n")]:
        assert native in source, native
        source = source.replace(native, stand_in)
    folder = tmp_path_factory.mktemp("avx512-emulated")
    (folder / "emulated.c").write_text(source)
    library = folder / "libemulated.so"
    subprocess.run([compiler, "-O1", "-fopenmp", "-shared", "-fPIC", "-o", str(library),
                    str(folder / "emulated.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(library))
    cpu_attention._declare(lib)
    assert lib.tidal_prefill_attention_available() == 1
    return lib


CASES = [
    # (q_lens, seq_lens, num_heads, num_kv_heads, block_size): chunks of 17-40 new tokens
    ([40, 1, 24], [90, 64, 24], 4, 1, 8),  # blocks of 8, smaller than the kernel's 16 lanes
    ([20, 3, 17], [20, 33, 60], 8, 2, 16),
    ([33, 1], [70, 9], 6, 3, 32),
]


@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (16, 0.8), (23, None),
                                        (1000, 1.5)])
def test_blocked_prefill_kernel_equals_reference(emulated, monkeypatch, window, cap):
    monkeypatch.setattr(cpu_attention, "load", lambda: emulated)
    backend = CpuBackend()
    for i, (q_lens, seq_lens, heads, kv_heads, block_size) in enumerate(CASES):
        case = make_case(q_lens, seq_lens, heads, kv_heads, 16, block_size, torch.float32,
                         seed=i, num_pad_tokens=2)
        if window is not None:
            windowed(case, window)
        meta = AttentionMetadata(torch.full((case.query.shape[0],), -1, dtype=torch.int64),
                                 case.block_tables, case.query_start_loc, case.seq_lens)
        plan = backend.prepare(meta, block_size, kv_heads, 16, torch.float32)
        assert plan.chunks, "no chunk reached the blocked kernel"
        caches = [backend.kv_cache(*c.shape, c.dtype, c.device).copy_(c)
                  for c in (case.key_cache, case.value_cache)]
        out = backend.attend(case.query, *caches, meta, plan, case.scale,
                             poisoned_like(case.query), sliding_window=window, soft_cap=cap)
        expected = paged_attention_ref(*case.args(), sliding_window=window, soft_cap=cap)
        assert_matches(out, expected, case.owned_rows())
