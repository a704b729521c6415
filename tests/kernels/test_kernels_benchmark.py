"""benchmarks/attention_kernels.py: its size arithmetic and its refusal to run without CUDA; and the
rule that importing tidal.kernels does not import triton."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch

BENCH_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "attention_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tidal_bench_kernels", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_bytes_and_flops(bench):
    shape = bench.AttnShape(num_heads=4, num_kv_heads=2, head_dim=8, block_size=16,
                            dtype_bytes=2)
    assert bench.kv_bytes(10, shape) == 2 * 10 * 2 * 8 * 2
    # decode: 3 requests at 20 tokens (2 blocks each): K/V + q/out + tables + qsl/seq_lens
    expected = 3 * 2 * 20 * 2 * 8 * 2 + 2 * 3 * 4 * 8 * 2 + 4 * (3 * 2 + 2 * 3 + 1)
    assert bench.attention_bytes(3, 1, 20, shape) == expected
    # prefill of 3 tokens, no context: pairs 1 + 2 + 3 = 6
    assert bench.attention_flops(1, 3, 3, shape) == 4 * 8 * 4 * 6
    # 2 new tokens after 5 cached: see 6 and 7 keys
    assert bench.attention_flops(2, 2, 7, shape) == 4 * 8 * 4 * 2 * 13
    # decode: one query sees all seq_len keys
    assert bench.attention_flops(1, 1, 100, shape) == 4 * 8 * 4 * 100
    assert bench.write_kv_bytes(5, shape) == 2 * bench.kv_bytes(5, shape) + 40
    assert bench.kv_cache_gib(1, 17, shape) == bench.kv_bytes(48, shape) / 2**30


def test_report_lines(bench):
    row = dict(kernel="decode", batch=64, ctx=4096, splits=1, ms=0.5, gbs=3000.0, pct=0.75)
    line = bench.format_row(row)
    assert "decode" in line and "4096" in line and "500.0" in line and "75.0%" in line
    assert "met" in bench.target_verdict([row]) and "NOT" not in bench.target_verdict([row])
    assert "NOT met" in bench.target_verdict([dict(row, pct=0.5)])
    assert "skipped" in bench.format_row(dict(kernel="decode", batch=256, ctx=32768,
                                              note="skipped"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_exits_with_message_without_cuda(bench):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--quick"])


def test_kernels_package_does_not_import_triton():
    """Only selecting the triton backend imports triton; the kernels package imports nothing
    of the workers (the attention seam points from workers to kernels only)."""
    code = ("import sys, torch, tidal.kernels.attention, tidal.kernels.attention.reference; "
            "[tidal.kernels.attention.select_attention_backend(name, 'cpu', dtype) "
            " for name in ('auto', 'numba', 'torch', 'reference') "
            " for dtype in (torch.float32, torch.bfloat16) "
            " if not (name == 'numba' and dtype == torch.bfloat16)]; "
            "sys.exit('triton' in sys.modules or 'tidal.workers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
