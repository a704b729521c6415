"""Issue 38 item 5: vLLM's habits carried over: flags spelled with underscores, several
served names, `from tidal import LLM, SamplingParams`, `tidal --version` (its real process
is in tests/e2e/test_first_hour.py)."""

import subprocess
import sys

from tidal.engine_core.args import config_from_args, config_to_argv
from tidal.frontend.cli import build_parser, dashed


def test_underscore_flags_are_read_as_dashed_ones():
    assert dashed(["serve", "m", "--max_model_len", "8", "--served_model_name=a_b",
                   "--served-model-name", "x_y", "--", "--not_a_flag"]) == \
        ["serve", "m", "--max-model-len", "8", "--served-model-name=a_b",
         "--served-model-name", "x_y", "--", "--not_a_flag"]


def test_several_served_names():
    ns = build_parser("serve").parse_args(
        dashed(["serve", "/m", "--served_model_name", "a", "b", "--max_num_seqs", "4"]))
    config = config_from_args(ns)
    assert config.model.names == ["a", "b"] and config.model.name == "a"
    assert config.model.model == "/m" and config.scheduler.max_num_seqs == 4
    again = config_from_args(build_parser("serve").parse_args(["serve",
                                                               *config_to_argv(config)]))
    assert again == config


def test_the_frontends_are_at_the_top_and_load_on_first_use():
    code = ("import sys, tidal; assert 'tidal.frontend' not in sys.modules; "
            "from tidal import LLM, SamplingParams, AsyncLLM; "
            "from tidal.frontend import LLM as L2; assert LLM is L2; "
            "print(SamplingParams(max_tokens=3).max_tokens, tidal.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "3"
