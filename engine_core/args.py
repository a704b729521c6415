"""Command-line flags for the engine (vLLM's names), and the config they build.

The flags are derived from the config dataclasses (`FLAGS` names the field each one sets):
a flag's default and type are its field's, and its `--help` text is the field's docstring,
so a setting is described once, where it is declared (a test holds every field to having a
flag and a docstring). `add_engine_args` adds them to any parser (`tidal serve`, `tidal
core`, benchmarks); `config_from_args` builds the `EngineConfig`; `config_to_argv` is its
inverse (the benchmarks turn a config back into `LLM` keyword arguments with it). A frontend
starting its own daemon sends the config itself instead, as msgspec JSON
(`config.encode_engine_config`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .config import (
    ATTENTION_BACKENDS, CONVERTS, CPU_WAIT_POLICIES, DEVICES, EXECUTOR_BACKENDS, KV_CACHE_DTYPES,
    RUNNERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig, LoRAConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    decode_engine_config,
)

_DTYPE_ALIASES = {
    "auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
    "float": "float32", "float32": "float32", "float64": "float64", "double": "float64",
}

_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'4294967296', '4G', '4GiB', '512Mi' -> bytes (k/M/G/T decimal, Ki/Mi/Gi/Ti binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512M)")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_count(text: str) -> int:
    """'32768', '32k' (32000), '32K' (32768), '1.5m' -> an integer, as vLLM's
    human_readable_int: lower-case units are decimal, upper-case binary (whole numbers only)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgKMG]?)\s*", text)
    if not m or (m.group(2).isupper() and "." in m.group(1)):
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 8192, 32k, 32K)")
    return int(float(m.group(1)) * _COUNT_UNITS[m.group(2)])


def _dtype(text: str) -> str:
    try:
        return _DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"dtype must be one of {sorted(_DTYPE_ALIASES)}, got {text!r}") from None


# ---------------------------------------------------------------------------------------------
# the flags, from the config dataclasses


@dataclass(frozen=True)
class _Flag:
    """One engine flag: the config field it sets; its name, parser and choices where they are
    not the field's own (`--block-size` for `block_size`, the annotation's type)."""

    section: type
    field: str
    name: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None  # default: int, float or str by the annotation
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None  # "+": one value or several (a list in the config)

    @property
    def option(self) -> str:
        return self.name or "--" + self.field.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_")


FLAGS: dict[str, list[_Flag]] = {
    "model": [
        _Flag(ModelConfig, "tokenizer"),
        _Flag(ModelConfig, "dtype", type=_dtype),
        _Flag(ModelConfig, "max_model_len"),
        _Flag(ModelConfig, "seed"),
        _Flag(ModelConfig, "served_model_name", nargs="+", metavar="NAME"),
        _Flag(ModelConfig, "revision"),
        _Flag(ModelConfig, "download_dir", metavar="DIR"),
        _Flag(ModelConfig, "structured_outputs_max_bytes", type=parse_bytes, metavar="BYTES"),
        _Flag(ModelConfig, "structured_outputs_compile_timeout", metavar="SECONDS"),
        _Flag(ModelConfig, "structured_outputs_cache_bytes", type=parse_bytes,
              metavar="BYTES"),
        _Flag(ModelConfig, "runner", choices=RUNNERS),
        _Flag(ModelConfig, "convert", choices=CONVERTS),
        _Flag(ModelConfig, "pooler_config", metavar="JSON"),
    ],
    "KV cache": [
        _Flag(CacheConfig, "block_size"),
        _Flag(CacheConfig, "enable_prefix_caching"),
        _Flag(CacheConfig, "gpu_memory_utilization"),
        _Flag(CacheConfig, "kv_cache_memory", type=parse_bytes, metavar="BYTES"),
        _Flag(CacheConfig, "num_kv_blocks_override", name="--num-gpu-blocks-override"),
        _Flag(CacheConfig, "kv_cache_dtype", choices=KV_CACHE_DTYPES),
    ],
    "scheduler": [
        _Flag(SchedulerConfig, "max_num_seqs"),
        _Flag(SchedulerConfig, "max_num_batched_tokens"),
        _Flag(SchedulerConfig, "enable_chunked_prefill"),
        _Flag(SchedulerConfig, "scheduling_policy", choices=SCHEDULING_POLICIES),
        _Flag(SchedulerConfig, "async_scheduling"),
        _Flag(SchedulerConfig, "max_num_queued_reqs"),
        _Flag(SchedulerConfig, "max_num_queued_tokens", type=parse_count),
        _Flag(SchedulerConfig, "stream_interval"),
        _Flag(SchedulerConfig, "long_prefill_token_threshold"),
        _Flag(SchedulerConfig, "max_queue_delay", metavar="SECONDS"),
        _Flag(SchedulerConfig, "step_cost_model", metavar="PATH"),
        _Flag(SchedulerConfig, "preemption_advice_quiet_s", metavar="SECONDS"),
        _Flag(SchedulerConfig, "speculative_config", metavar="JSON"),
    ],
    "parallel": [
        _Flag(ParallelConfig, "tensor_parallel_size", aliases=("-tp",)),
        _Flag(ParallelConfig, "pipeline_parallel_size", aliases=("-pp",)),
        _Flag(ParallelConfig, "data_parallel_size", aliases=("-dp",)),
        _Flag(ParallelConfig, "device", choices=DEVICES),
        _Flag(ParallelConfig, "attention_backend", choices=ATTENTION_BACKENDS),
        _Flag(ParallelConfig, "cpu_kernels", metavar="auto[,OPTION]|torch"),
        _Flag(ParallelConfig, "enforce_eager"),
        _Flag(ParallelConfig, "cpu_threads"),
        _Flag(ParallelConfig, "cpu_wait_policy", choices=CPU_WAIT_POLICIES),
        _Flag(ParallelConfig, "worker_timeout"),
        _Flag(ParallelConfig, "max_worker_restarts"),
        _Flag(ParallelConfig, "cpu_affinity"),
        _Flag(ParallelConfig, "distributed_executor_backend", choices=EXECUTOR_BACKENDS),
    ],
    "LoRA": [
        _Flag(LoRAConfig, "enable_lora"),
        _Flag(LoRAConfig, "max_loras"),
        _Flag(LoRAConfig, "max_lora_rank"),
        _Flag(LoRAConfig, "max_cpu_loras"),
    ],
}
"""Every engine flag but MODEL, grouped as `--help` shows them. A flag's default, help text
and type come from its config field (its docstring is the help), so the dataclasses are the
one place a setting is described."""


@functools.cache
def _module_classes(module: str) -> dict[str, ast.ClassDef]:
    """The top-level classes of module `module`, parsed once: `inspect.getsource(cls)`
    parses a class's whole module again for each class (~7 ms a class: 40-50 ms of
    every `tidal serve` start for the config's 7 sections against 5 ms, 2-vCPU Zen 4 EPYC)."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass `cls`, whitespace folded."""
    body = _module_classes(cls.__module__)[cls.__name__].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _field(flag: _Flag) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(flag.section) if f.name == flag.field)


def _is_bool(flag: _Flag) -> bool:
    return str(_field(flag).type).startswith("bool")


def _parser_type(flag: _Flag):
    if flag.type is not None or flag.choices is not None:
        return flag.type
    annotation = str(_field(flag).type)
    return int if annotation.startswith("int") else float if annotation.startswith("float") \
        else None


def flag_help(flag: _Flag) -> str:
    """The field's docstring and its default, for argparse (a '%' doubled)."""
    default = _field(flag).default
    text = field_docs(flag.section)[flag.field]
    if isinstance(default, bool):
        text += f" (default: {'on' if default else 'off'})"
    elif default is not None and default is not dataclasses.MISSING:
        text += f" (default: {default})"
    return text.replace("%", "%%")


def add_engine_args(parser: argparse.ArgumentParser, docs: bool = True) -> None:
    """Add MODEL and the model, cache, scheduler and parallel flags (vLLM names and
    defaults; help from the config fields' docstrings). `docs=False` leaves the help text
    out, for a parser that never prints it: reading the docstrings parses the config's
    source, 0.1 s of every engine start on the 2-vCPU VM (`LLM` and the daemon a frontend
    starts each built this parser)."""
    for title, flags in FLAGS.items():
        group = parser.add_argument_group(title)
        if title == "model":
            group.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                               help="same as --model (default in tidal serve/core/generate: "
                                    "the bundled demo model)")
            group.add_argument("--model", default=None,
                               help=field_docs(ModelConfig)["model"] if docs else None)
        for flag in flags:
            default = _field(flag).default
            kwargs: dict[str, Any] = {
                "default": None if default is dataclasses.MISSING else default,
                "help": flag_help(flag) if docs else None, "dest": flag.dest}
            if _is_bool(flag):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs.update(type=_parser_type(flag), choices=flag.choices,
                              metavar=flag.metavar, nargs=flag.nargs)
            group.add_argument(flag.option, *flag.aliases, **kwargs)


def config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """Build the config from parsed flags (ValueError naming the field on bad values); a
    whole config sent by a frontend (the hidden `--engine-config`, msgspec JSON) wins."""
    whole = getattr(ns, "engine_config", None)
    if whole:
        return decode_engine_config(whole)
    model_tag, model_flag = getattr(ns, "model_tag", None), getattr(ns, "model", None)
    if model_tag and model_flag and model_tag != model_flag:
        raise ValueError(f"model given twice: {model_tag!r} and --model {model_flag!r}")
    model = model_tag or model_flag
    if not model:
        raise ValueError("model is required (MODEL or --model)")
    values: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}}
    for flags in FLAGS.values():
        for flag in flags:
            values.setdefault(flag.section, {})[flag.field] = getattr(ns, flag.dest)
    return EngineConfig(model=ModelConfig(**values[ModelConfig]),
                        cache=CacheConfig(**values[CacheConfig]),
                        scheduler=SchedulerConfig(**values[SchedulerConfig]),
                        parallel=ParallelConfig(**values[ParallelConfig]),
                        lora=LoRAConfig(**values[LoRAConfig]))


def config_to_argv(config: EngineConfig) -> list[str]:
    """Flags that rebuild `config` through add_engine_args + config_from_args."""
    sections = {ModelConfig: config.model, CacheConfig: config.cache,
                SchedulerConfig: config.scheduler, ParallelConfig: config.parallel,
                LoRAConfig: config.lora}
    argv = ["--model", config.model.model]
    for flags in FLAGS.values():
        for flag in flags:
            value = getattr(sections[flag.section], flag.field)
            if isinstance(value, bool):
                argv.append(flag.option if value else "--no-" + flag.option[2:])
            elif isinstance(value, list):
                argv += [flag.option, *map(str, value)]
            elif value is not None:
                argv += [flag.option, repr(value) if isinstance(value, float) else str(value)]
    return argv
