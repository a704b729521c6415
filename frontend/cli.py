"""The `tidal` command: a thin dispatcher over subcommands owned by other modules.

    tidal core [MODEL] [engine flags] [--listen ADDRESS] the engine-core daemon
    tidal serve [MODEL] [engine flags] [server flags]    the OpenAI-compatible HTTP server
    tidal generate "PROMPT" [--model MODEL | --engine ADDRESS] [sampling flags]
    tidal bench ...                                      benchmarks
    tidal tune [profile | simulate] ...                  pick settings by simulation

Each subcommand's module exports `add_*_args(parser)` and `run_*(ns) -> int`. Only the chosen
subcommand's module is imported, so `tidal core` starts without loading the HTTP server (or
torch) into the daemon. Without a MODEL, core, serve, generate and bench use the bundled demo
model (tidal.frontend.demo); a MODEL may be a folder, a GGUF file or a Hugging Face Hub id,
fetched once before anything starts (engine_core/hub.py). Flags may be spelled with
underscores, as vLLM accepts them (`--max_model_len`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function(s) adding its flags, function running it, one-line help)
_SUBCOMMANDS: dict[str, tuple[str, tuple[str, ...], str, str]] = {
    "core": ("tidal.engine_core.daemon", ("tidal.engine_core.args:add_engine_args",
                                          "add_daemon_args"),
             "tidal.frontend.cli:run_core",
             "run the engine-core daemon (scheduler, KV cache, workers)"),
    "serve": ("tidal.frontend.server.serve", ("add_serve_args",), "run_serve",
              "run the OpenAI-compatible HTTP server (starts or attaches to an engine core)"),
    "generate": ("tidal.frontend.cli", ("add_generate_args",), "run_generate",
                 "print a completion of PROMPT"),
    "bench": ("tidal.frontend.bench.cli", ("add_bench_args",), "run_bench",
              "benchmarks (throughput, serving)"),
    "top": ("tidal.frontend.top", ("add_top_args",), "run_top",
            "the live view of a server's batch in this terminal (docs/ui.md)"),
}
_SELF_PARSING: dict[str, tuple[str, str]] = {
    "tune": ("tidal.frontend.tune.cli:main", "pick --max-num-seqs, --max-num-batched-tokens, KV memory "
             "and more by simulating the scheduler (tidal tune --help)"),
}
"""Subcommands that parse their own arguments: name -> (main(argv), one-line help)."""


def _resolve(module: str, name: str):
    if ":" in name:
        module, name = name.split(":")
    return getattr(importlib.import_module(module), name)


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The `tidal` parser; only `command`'s flags are loaded (its module imported)."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="tidal", description="tidal LLM inference engine")
    parser.add_argument("-V", "--version", action="version", version=f"tidal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, adders, _, help_text) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            for adder in adders:
                _resolve(module, adder)(p)
    for name, (_, help_text) in _SELF_PARSING.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def dashed(argv: list[str]) -> list[str]:
    """`--max_model_len 8` as `--max-model-len 8` (vLLM accepts both spellings): underscores
    in a long option's name become dashes; values, and everything after `--`, are kept."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tidal` console script; returns the exit code."""
    argv = dashed(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] in _SELF_PARSING:
        return int(_resolve("", _SELF_PARSING[argv[0]][0])(argv[1:]) or 0)
    command = argv[0] if argv and argv[0] in _SUBCOMMANDS else None
    try:
        parser = build_parser(command)
    except ImportError as e:
        print(f"tidal {command}: not available in this install ({e})", file=sys.stderr)
        return 2
    ns = parser.parse_args(argv)
    module, _, runner, _ = _SUBCOMMANDS[ns.command]
    return int(_resolve(module, runner)(ns) or 0)


# ---------------------------------------------------------------------------------------------
# tidal core


def run_core(ns: argparse.Namespace) -> int:
    """`tidal core`: the daemon, on the bundled demo model ("tidal-demo") when no MODEL."""
    from ..engine_core.daemon import run_daemon_from_args
    from .demo import apply_demo_model_default

    from ..engine_core.args import config_from_args
    from ..engine_core.config import encode_engine_config
    from ..engine_core.model_files import prepare_model

    try:
        if not ns.engine_config and not ns.generate_key_file:  # a frontend's config is ready
            apply_demo_model_default(ns)
            # a Hub id is fetched here, once; the daemon (or -dp router) gets local paths
            ns.engine_config = encode_engine_config(prepare_model(config_from_args(ns)))
    except ValueError as e:
        print(f"tidal core: {e}", file=sys.stderr)
        return 2
    return run_daemon_from_args(ns)  # with -dp N: the router and its N cores


# ---------------------------------------------------------------------------------------------
# tidal generate


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """PROMPT, sampling flags, --engine, and the engine flags (to start a private daemon)."""
    from ..engine_core.args import add_engine_args

    parser.add_argument("prompt", metavar="PROMPT", help="the text to complete")
    add_engine_args(parser)
    g = parser.add_argument_group("generation")
    g.add_argument("--engine", default=None,
                   help="attach to the engine core at this address instead of starting one")
    g.add_argument("--engine-key-file", default=None, help="CURVE key file for --engine")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest "
                   "tokens (default 0 = off)")
    g.add_argument("--n", type=int, default=1, help="completions to print")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None, help="the request's own seed")


def run_generate(ns: argparse.Namespace) -> int:
    """Generate for one prompt and print the completion(s); the exit code."""
    from ..engine_core.args import config_from_args
    from .async_llm import AsyncLLM, run
    from .llm import default_model
    from ..ipc.messages import SamplingParams

    try:
        params = SamplingParams(n=ns.n, max_tokens=ns.max_tokens, temperature=ns.temperature,
                                top_p=ns.top_p, top_k=ns.top_k, stop=ns.stop,
                                seed=ns.sampling_seed)
        config = None
        if ns.engine is None:
            if not (ns.model_tag or ns.model):
                ns.model = default_model()
            config = config_from_args(ns)
    except ValueError as e:
        print(f"tidal generate: {e}", file=sys.stderr)
        return 2

    async def go() -> int:
        llm = await AsyncLLM.create(config, engine=ns.engine, key_file=ns.engine_key_file,
                                    echo_daemon_output=False)
        try:
            async for out in llm.generate(ns.prompt, params):
                for comp in out.outputs:
                    if ns.n == 1:
                        sys.stdout.write(comp.delta_text)
                        sys.stdout.flush()
                    elif comp.finish_reason is not None:
                        print(f"--- completion {comp.index} ({comp.finish_reason})\n{comp.text}")
                if out.finished and any(c.finish_reason == "error" for c in out.outputs):
                    print(f"\ntidal generate: {out.outputs[0].error}", file=sys.stderr)
                    return 1
            if ns.n == 1:
                print()
            return 0
        except ValueError as e:
            print(f"tidal generate: {e}", file=sys.stderr)
            return 2
        finally:
            await llm.close()

    try:
        return run(go())
    except RuntimeError as e:
        print(f"tidal generate: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
