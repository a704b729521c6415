"""The CPU op seam (`kernels/cpu/ops.py`): `cpu_kernels` read in one place (and the engine
config's check agreeing with it), each choice giving the ops it names, and the start-up line
saying what was built, what was not and why, and what runs instead: a WARNING that names the
slower paths where there is no C compiler."""

import logging
import re

import pytest
import torch

from tidal.engine_core import config
from tidal.kernels.cpu import native, ops, small_m_gemm
from tidal.kernels.cpu.ops import TORCH_OPS, parse_cpu_kernels, select_cpu_ops

SETTINGS = ["auto", "torch", "auto,no-amx", "auto,no-panels", "auto,no-fused",
            "auto,no-amx,no-fused", "auto,march=haswell", "auto,no-fused,march=znver4"]
NOT_SETTINGS = ["", "Auto", "torch,no-amx", "auto,march=", "auto,no-x", "auto, no-amx",
                "auto,march=a,march=b", "no-amx", "cpu"]


@pytest.mark.parametrize("spec", SETTINGS)
def test_settings_parse_and_the_engine_config_takes_them(spec):
    assert parse_cpu_kernels(spec).spec == spec
    assert config.cpu_kernels_ok(spec)
    assert config.ParallelConfig(cpu_kernels=spec).cpu_kernels == spec


@pytest.mark.parametrize("spec", NOT_SETTINGS)
def test_anything_else_is_a_value_error_naming_the_setting(spec):
    with pytest.raises(ValueError, match="cpu_kernels"):
        parse_cpu_kernels(spec)
    assert not config.cpu_kernels_ok(spec)
    with pytest.raises(ValueError, match="cpu_kernels"):
        config.ParallelConfig(cpu_kernels=spec)


def test_the_engine_config_names_the_seams_choices():
    assert config.CPU_KERNELS == ops.CPU_KERNELS
    assert config.CPU_KERNEL_OPTIONS == ops.CPU_KERNEL_OPTIONS


def test_options_leave_out_what_they_name_and_what_needs_it():
    auto = parse_cpu_kernels("auto")
    assert auto.kernels and auto.panels and auto.amx and auto.fused and auto.march == "native"
    assert not parse_cpu_kernels("auto,no-amx").amx and parse_cpu_kernels("auto,no-amx").fused
    no_panels = parse_cpu_kernels("auto,no-panels")  # AMX and the fused call need the panels
    assert not (no_panels.panels or no_panels.amx or no_panels.fused)
    assert parse_cpu_kernels("auto,march=haswell").march == "haswell"
    assert not parse_cpu_kernels("torch").kernels


def test_torch_ops_load_nothing_and_give_no_gemm(monkeypatch):
    monkeypatch.setattr(native, "_builds", {})
    chosen = select_cpu_ops("torch")
    assert native._builds == {} and chosen.libraries == ()
    assert chosen.gemm(torch.randn(64, 32)) is None and TORCH_OPS.gemm(torch.randn(64, 32)) is None
    assert "cpu_kernels=torch" in chosen.summary()


def test_the_line_names_every_library_built_or_not():
    chosen = select_cpu_ops("auto")
    line = chosen.summary()
    for name in ("layer_ops", "small_m_gemm", "amx_gemm", "decode_attention", "decoder_layers"):
        assert name in line
    assert line.startswith("CPU ops (cpu_kernels=auto): C built: ") and "\n" not in line
    if small_m_gemm.load() is None:
        pytest.skip("the panel kernel does not build here")
    assert chosen.panels and chosen.gemm(torch.randn(64, 32)) is not None
    assert chosen.layer_ops is not None and not chosen.no_compiler


def test_options_are_said_left_out():
    line = select_cpu_ops("auto,no-fused").summary()
    assert re.search(r"left out: decoder_layers \(the layers call their kernels one by one\)",
                     line)
    assert not select_cpu_ops("auto,no-fused").fused


def test_without_a_compiler_the_line_is_a_warning_naming_the_slower_paths(monkeypatch, tmp_path,
                                                                         caplog):
    monkeypatch.setattr(native, "_builds", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    chosen = select_cpu_ops("auto")
    assert chosen.no_compiler and chosen.layer_ops is None
    assert not (chosen.panels or chosen.amx or chosen.fused)
    with caplog.at_level(logging.INFO):
        ops.log_cpu_ops(chosen, logging.getLogger("test"), "rank 0: ")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    text = record.getMessage()
    assert "C built: none" in text and "no-such-compiler' not found" in text
    for slower in ("RMSNorm and rotary take numba", "small batches take oneDNN",
                   "attention_backend=auto takes numba's kernels",
                   "the layers call their kernels one by one"):
        assert slower in text
    # the ops still compute: numba's norm, oneDNN's GEMM
    x, w = torch.randn(3, 64), torch.randn(64)
    torch.testing.assert_close(chosen.rms_norm(x, w, 1e-5), TORCH_OPS.rms_norm(x, w, 1e-5))
    if torch.backends.mkldnn.is_available():
        gemm = chosen.gemm(torch.randn(64, 32))
        assert gemm is not None and gemm.panels is None


def test_march_builds_every_library_for_that_cpu(monkeypatch, tmp_path):
    """`march=haswell`: the libraries are built with -march=haswell (the AVX2 paths)."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_builds", {})
    monkeypatch.setattr(native, "march", native.march)
    chosen = select_cpu_ops("auto,march=haswell")
    assert native.march == "haswell" and "-march=haswell" in native.flags()
    assert "built for -march=haswell" in chosen.summary()
    if chosen.panels:
        assert not small_m_gemm.float_panels()  # an AVX2 build, whatever this CPU
