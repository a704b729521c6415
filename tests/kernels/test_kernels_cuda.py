"""On a CUDA machine: the compiled (not interpreted) kernels against the references at model
sizes, in a subprocess with TRITON_INTERPRET=0 (this suite's conftest turns the interpreter
on for everything else)."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).with_name("cuda_check.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_match_reference_on_cuda():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=SCRIPT.parent)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert proc.stdout.count("ok ") == 15
