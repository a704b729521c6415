"""GPU code quality without a GPU: the attention kernels compile for sm_90 (H100) with the
launches `choose_launch` picks, without register spills, and their K/V loads become 16-byte
asynchronous copies (vectorised and software-pipelined), not scalar loads."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("sm90_compile.py")


def _have_nvidia_toolchain() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump"))


@pytest.mark.skipif(not _have_nvidia_toolchain(), reason="triton without its NVIDIA toolchain")
def test_attention_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 7
    for report in reports[5:]:  # KV write and split-K merge
        assert report["stack"] == 0 and report["local"] == 0, report
    reports = reports[:5]
    for report in reports:
        assert report["stack"] == 0 and report["local"] == 0, report  # no spills
        assert report["reg"] <= 255, report
        assert report["cp_async_16b"] > 0 and report["scalar_b16_loads"] == 0, report
        assert report["dynamic_shared"] <= 227 * 1024, report
    assert any(r["launch"]["num_splits"] > 1 for r in reports)  # the split-K variant too
