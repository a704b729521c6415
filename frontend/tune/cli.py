"""`tidal tune`: pick serving settings by simulating tidal's own scheduler.

    tidal tune profile [MODEL] [engine flags] [--duration 60]
        measure worker steps on this machine and fit the step cost model (cached per model,
        dtype, device, TP size, threads and attention backend)
    tidal tune simulate [MODEL] [engine flags] [workload] [--request-rate R]
        predict one setting: the report `tidal bench serve` prints, from the simulator
    tidal tune [MODEL] [engine flags] [workload] --request-rate R --slo-ttft-p99 1s
               --slo-itl-p99 200ms [grids]
        search max-num-seqs, max-num-batched-tokens, KV memory, chunked prefill and policy

The workload is a `tidal bench` dataset (the same flags, the same `--seed`: the same lengths
and arrival times `tidal bench serve` would send) or `--trace FILE` (recorded by `tidal serve
--record-trace`). Here `--seed` is the workload seed; sampling does not matter to a simulation.
Without MODEL, the bundled demo model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from ...engine_core.advice.step_cost import (
    StepCostModel, config_profile_key, find_profile, profile_path,
)
from ...engine_core.args import add_engine_args, config_from_args, parse_bytes
from ...engine_core.config import EngineConfig, resolve_max_model_len

DEFAULT_MAX_NUM_SEQS = (16, 32, 64, 128, 256)
DEFAULT_MAX_NUM_BATCHED_TOKENS = (512, 1024, 2048, 4096, 8192)


def main(argv: list[str] | None = None) -> int:
    """`tidal tune ...`; the exit status (2 for bad arguments or a missing profile)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in ("profile", "simulate") else "search"
    rest = argv[1:] if command != "search" else argv
    parser, runner = {"profile": (_profile_parser, run_profile),
                      "simulate": (_simulate_parser, run_simulate),
                      "search": (_search_parser, run_search)}[command]
    ns = parser().parse_args(rest)
    try:
        return runner(ns)
    except (ValueError, RuntimeError) as e:
        name = "tidal tune" + ("" if command == "search" else f" {command}")
        print(f"{name}: {e}", file=sys.stderr)
        return 2


# -- parsers -----------------------------------------------------------------------------------


def _profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal tune profile", description="Measure one worker step over a grid of shapes "
        "on this machine and fit the step cost model; the engine flags say what to measure "
        "(model, dtype, device, threads, KV cache).")
    add_engine_args(p)
    g = p.add_argument_group("profile")
    g.add_argument("--duration", type=float, default=60.0,
                   help="seconds of measurement (default: 60)")
    g.add_argument("--output", default=None, help="also write the JSON here (it is always "
                   "written to the cache folder, where tidal tune and --max-queue-delay look)")
    g.add_argument("--max-decode-reqs", type=int, default=None,
                   help="most decode requests in a measured step (default: --max-num-seqs)")
    g.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="most prefill tokens in a measured step (default: "
                        "--max-num-batched-tokens)")
    g.add_argument("--serving", action=argparse.BooleanOptionalAction, default=True,
                   help="then measure what serving adds to each step and request, through a "
                        "real tidal serve with these flags, about 20 s (default: on)")
    return p


def _add_workload_args(p: argparse.ArgumentParser, default_rate: float | None) -> None:
    from ..bench.cli import add_dataset_args

    add_dataset_args(p, with_seed=False)  # --seed is the engine flags' (see the module text)
    g = p.add_argument_group("traffic")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="a recorded trace (tidal serve --record-trace) instead of a dataset")
    g.add_argument("--request-rate", type=float, default=default_rate,
                   help="requests/s: a dataset's Poisson (Gamma) arrival rate, or a trace "
                        "rescaled to this mean rate" +
                        (" (default: inf, all at once)" if default_rate else
                         " (required with a dataset)"))
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 Poisson, <1 burstier (default: 1)")


def _add_output_args(p: argparse.ArgumentParser, plot_default: str | None) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--plot", default=plot_default, metavar="FILE.png",
                   help="draw the figure here" + (f" (default: {plot_default}; '' for none)"
                                                  if plot_default else ""))
    g.add_argument("--result-file", default=None, help="write the results as JSON here")


def _simulate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal tune simulate", description="Predict what `tidal bench serve` would "
        "report for one setting (the engine flags) on a workload, by simulation.")
    add_engine_args(p)
    _add_workload_args(p, default_rate=math.inf)
    _add_output_args(p, None)
    return p


def _search_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal tune", description=__doc__,
        epilog="Subcommands: `tidal tune profile --help`, `tidal tune simulate --help`.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.usage = ("tidal tune [profile | simulate] [MODEL] [engine flags] [workload] "
               "--request-rate R --slo-ttft-p99 T --slo-itl-p99 T [grids]")
    add_engine_args(p)
    _add_workload_args(p, default_rate=None)
    g = p.add_argument_group("SLO")
    g.add_argument("--slo-ttft-p99", default=None, metavar="T",
                   help="p99 time to first token limit, e.g. 1s or 500ms")
    g.add_argument("--slo-itl-p99", default=None, metavar="T",
                   help="p99 inter-token latency limit, e.g. 200ms")
    g = p.add_argument_group("search grid (comma-separated values)")
    g.add_argument("--max-num-seqs-grid", default=",".join(map(str, DEFAULT_MAX_NUM_SEQS)))
    g.add_argument("--max-num-batched-tokens-grid",
                   default=",".join(map(str, DEFAULT_MAX_NUM_BATCHED_TOKENS)))
    g.add_argument("--kv-cache-memory-grid", default=None, metavar="SIZES",
                   help="KV cache bytes per rank, e.g. 512MiB,1GiB (default: the engine "
                        "flags' KV cache only)")
    g.add_argument("--chunked-prefill-grid", default="on,off", help="on, off or both")
    g.add_argument("--scheduling-policy-grid", default=None,
                   help="fcfs, priority or both (default: both when the trace has "
                        "priorities, else fcfs)")
    g.add_argument("--top", type=int, default=10, help="rows in the table (default: 10)")
    g.add_argument("--jobs", type=int, default=1,
                   help="simulate in this many processes (default: 1)")
    _add_output_args(p, "tidal-tune.png")
    return p


# -- shared set-up ---------------------------------------------------------------------------


def _config(ns: argparse.Namespace) -> EngineConfig:
    from ..demo import apply_demo_model_default

    from ...engine_core.model_files import prepare_model

    apply_demo_model_default(ns)
    return prepare_model(config_from_args(ns))  # a Hub id: fetched once, here


def _cost_model(config: EngineConfig) -> tuple[StepCostModel, str]:
    path = find_profile(config)
    if path is None:
        key = config_profile_key(config)
        raise ValueError(
            f"no step cost model for {key['model']} (dtype {key['dtype']}, device "
            f"{key['device']}, {key['threads']} threads, attention {key['attention_backend']}"
            "): run `tidal tune profile` with the same model and engine flags first (about a "
            "minute), or pass --step-cost-model FILE")
    return StepCostModel.load(path), path


def num_kv_blocks(config: EngineConfig, cost: StepCostModel,
                  kv_cache_memory: int | None = None) -> int:
    """KV blocks of `config` (or of `kv_cache_memory` bytes) as the workers would find them."""
    if kv_cache_memory is None and config.cache.num_kv_blocks_override is not None:
        return config.cache.num_kv_blocks_override
    kv_bytes = kv_cache_memory or config.cache.kv_cache_memory
    if kv_bytes is not None:
        block_bytes = cost.kv_block_bytes(config.cache.block_size)
        if block_bytes is None:
            raise ValueError("the step cost model does not record kv_block_bytes; give "
                             "--num-gpu-blocks-override instead of a KV cache size")
        return kv_bytes // block_bytes
    if not cost.info.get("num_kv_blocks"):
        raise ValueError("the step cost model does not record the KV cache it measured; give "
                         "--kv-cache-memory or --num-gpu-blocks-override")
    return int(cost.info["num_kv_blocks"])


def _trace(ns: argparse.Namespace, config: EngineConfig):
    """(trace, its request rate)."""
    from ...engine_core.advice.trace import read_trace
    from .workload import trace_from_dataset

    rate = ns.request_rate
    if rate is not None and not rate > 0:
        raise ValueError(f"request_rate must be > 0, got {rate}")
    if ns.burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {ns.burstiness}")
    if ns.trace:
        trace = read_trace(ns.trace)
        recorded = trace.mean_rate()
        if rate is None or math.isinf(rate):
            return trace, recorded
        if math.isinf(recorded):
            raise ValueError("--request-rate cannot rescale a trace whose requests all "
                             "arrive at once")
        return trace.scaled(rate / recorded), rate
    if rate is None:
        raise ValueError("--request-rate is required with a dataset (requests per second)")
    from ..bench.cli import dataset_config_from_args
    from ..bench.datasets import load_tokenizer

    dataset = dataset_config_from_args(ns)
    tokenizer = load_tokenizer(config.model.tokenizer_path) if dataset.name == "jsonl" else None
    return trace_from_dataset(dataset, rate, ns.burstiness, ns.seed, tokenizer), rate


def _write_json(path: str | None, document: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=2, default=str)
        print(f"results written to {path}")


# -- profile ---------------------------------------------------------------------------------


def profile(config: EngineConfig, duration_s: float = 60.0, seed: int = 0,
            output: str | None = None, max_decode_reqs: int | None = None,
            max_prefill_tokens: int | None = None,
            serving: bool = True) -> tuple[StepCostModel, str]:
    """Time worker steps and fit the step cost model (`engine_core/advice/profile.py`); with
    `serving`, measure its serving terms through a real `tidal serve` with `config` too
    (`serving_profile.py`); save it. The model, and where it was written."""
    from ...engine_core.advice.profile import profile_steps

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    model = profile_steps(config, duration_s, seed, max_decode_reqs, max_prefill_tokens)
    if serving:
        from .serving_profile import measure_serving_terms

        terms = measure_serving_terms(config, model)
        model = dataclasses.replace(
            model, request_latency_s=terms.request_latency_s,
            per_prompt_token_latency_s=terms.per_prompt_token_latency_s,
            per_step_overhead_s=terms.per_step_overhead_s,
            per_streamed_token_s=terms.per_streamed_token_s,
            per_arrival_s=terms.per_arrival_s,
            per_arrival_prompt_token_s=terms.per_prompt_token_latency_s,
            info={**model.info, "serving": terms.info})
    # what else ran: a profile taken beside other work prices every step too high (46 ms a
    # step instead of 3.6 in one such run), and `tidal tune` then found 0 of 45 settings
    # meeting SLOs that a quiet machine meets
    model = dataclasses.replace(model, info={**model.info, "load_average_before": load,
                                             "cores": os.cpu_count()})
    cached = profile_path(config_profile_key(config))
    model.save(cached)  # always where `tidal tune` and --max-queue-delay look
    if output and os.path.abspath(output) != os.path.abspath(cached):
        model.save(output)
    return model, output or cached


def busy_warning(info: dict) -> str | None:
    """A line saying the machine was busy when the profile started (its 1-minute load
    average over half its cores), or None."""
    load, cores = info.get("load_average_before"), info.get("cores") or 1
    if load is None or load <= cores / 2:
        return None
    return (f"warning: the machine was busy when this profile started (load average "
            f"{load:.1f} on {cores} cores): other processes' work inflates every measured "
            "step cost, and `tidal tune` will predict slower steps than a quiet machine "
            "runs; profile again when the machine is quiet")


def run_profile(ns: argparse.Namespace) -> int:
    from ...engine_core.advice.profile import format_fit

    config = _config(ns)
    start = time.monotonic()
    model, path = profile(config, ns.duration, ns.seed, ns.output, ns.max_decode_reqs,
                          ns.max_prefill_tokens, serving=ns.serving)
    info = model.info
    steps = sum(s.get("num_steps", 1) for s in info.get("samples", []))
    print(f"measured {info['num_shapes']} step shapes ({steps} steps) in "
          f"{time.monotonic() - start:.0f} s on "
          f"{info['device']} ({info['dtype']}, {info['threads']} threads, "
          f"{info['attention_backend']} attention)")
    print(format_fit(model))
    if "serving" in info:
        print(f"served (through tidal serve): + {model.per_step_overhead_s * 1e3:.2f} ms per "
              f"step + {model.per_streamed_token_s * 1e3:.3f} ms per token streamed, "
              f"+ {model.request_latency_s * 1e3:.1f} ms + "
              f"{model.per_prompt_token_latency_s * 1e3:.4f} ms per prompt token to each "
              f"request's first token, + {model.per_arrival_s * 1e3:.1f} ms + the same per "
              "prompt token to the step a request arrives during")
    cached = profile_path(config_profile_key(config))
    print(f"step cost model written to {path}" + (
        "" if path == cached else f" and to {cached} (where tidal tune and --max-queue-delay "
        "look)"))
    warning = busy_warning(info)
    if warning:
        print(warning)
    return 0


# -- simulate --------------------------------------------------------------------------------


def run_simulate(ns: argparse.Namespace) -> int:
    from ..bench.metrics import format_report
    from ...engine_core.advice.simulator import simulate

    config = _config(ns)
    cost, cost_path = _cost_model(config)
    max_model_len = resolve_max_model_len(config)
    blocks = num_kv_blocks(config, cost)
    trace, rate = _trace(ns, config)
    start = time.monotonic()
    result = simulate(config, blocks, max_model_len, cost, trace)
    elapsed = time.monotonic() - start
    summary = result.summary()
    summary["request_rate"] = "inf" if math.isinf(rate) else rate
    print(format_report(summary, title="Simulated Serving Result"))
    print(f"simulated {len(trace.requests)} requests ({summary['num_steps']} steps, "
          f"{blocks} KV blocks, {summary['refused']} refused as too long) in {elapsed:.1f} s; "
          f"most waiting {summary['max_num_waiting']}, most running "
          f"{summary['max_num_running']}, peak KV cache usage "
          f"{100 * summary['max_kv_cache_usage']:.0f}%; cost model {cost_path}")
    if ns.plot:
        from .plot import plot_tune
        from ...engine_core.advice.tuner import SLO, Evaluation, Setting

        s = config.scheduler
        setting = Setting(s.max_num_seqs, s.max_num_batched_tokens, blocks,
                          s.enable_chunked_prefill, s.scheduling_policy,
                          config.cache.kv_cache_memory)
        point = {"rate": rate, **summary}
        plot_tune([Evaluation(setting, summary, True, rate, curve=[point])],
                  rate if not math.isinf(rate) else 0.0, SLO(), ns.plot, result)
        print(f"plot written to {ns.plot}")
    _write_json(ns.result_file, {"command": "tune simulate", "cost_model": cost_path,
                                 "num_kv_blocks": blocks, "summary": summary})
    return 0


# -- search ----------------------------------------------------------------------------------


def _ints(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{name}: not a comma-separated list of integers: {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{name}: values must be positive, got {text!r}")
    return values


def _choices(text: str, allowed: dict, name: str) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or any(x not in allowed for x in items):
        raise ValueError(f"{name}: expected some of {', '.join(allowed)}, got {text!r}")
    return [allowed[x] for x in dict.fromkeys(items)]


def run_search(ns: argparse.Namespace) -> int:
    from ...engine_core.advice.simulator import simulate
    from ...engine_core.advice.tuner import (
        SLO, evaluations_to_json, format_table, parse_seconds, search, settings_grid,
    )

    slo = SLO(parse_seconds(ns.slo_ttft_p99) if ns.slo_ttft_p99 else None,
              parse_seconds(ns.slo_itl_p99) if ns.slo_itl_p99 else None)
    config = _config(ns)
    cost, cost_path = _cost_model(config)
    max_model_len = resolve_max_model_len(config)
    trace, rate = _trace(ns, config)
    if math.isinf(rate):
        raise ValueError("--request-rate must be finite for a search")
    seqs = _ints(ns.max_num_seqs_grid, "max_num_seqs_grid")
    tokens = _ints(ns.max_num_batched_tokens_grid, "max_num_batched_tokens_grid")
    if ns.kv_cache_memory_grid:
        sizes = [parse_bytes(x) for x in ns.kv_cache_memory_grid.split(",") if x.strip()]
        kv = [(num_kv_blocks(config, cost, size), size) for size in sorted(set(sizes))]
    else:
        kv = [(num_kv_blocks(config, cost), config.cache.kv_cache_memory)]
    chunked = _choices(ns.chunked_prefill_grid, {"on": True, "off": False},
                       "chunked_prefill_grid")
    has_priorities = len({r.priority for r in trace.requests}) > 1
    policy_text = ns.scheduling_policy_grid or ("fcfs,priority" if has_priorities else "fcfs")
    policies = _choices(policy_text, {"fcfs": "fcfs", "priority": "priority"},
                        "scheduling_policy_grid")
    settings = settings_grid(seqs, tokens, kv, chunked, policies, config, max_model_len)
    if not settings:
        raise ValueError("no setting of the grid is valid for this model (max_model_len "
                         f"{max_model_len}, KV blocks {[b for b, _ in kv]})")
    _warn_outside_profile(cost, seqs, tokens)
    print(f"tidal tune: {len(settings)} settings x {len(trace.requests)} requests at "
          f"{rate:g} req/s, SLO {slo.describe()}; cost model {cost_path}"
          + ("" if has_priorities or ns.scheduling_policy_grid else
             "; policy fcfs only (the trace has no priorities)"), flush=True)
    start = time.monotonic()

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            print(f"  {done}/{total} settings simulated ({time.monotonic() - start:.0f} s)",
                  flush=True)

    evaluations = search(config, max_model_len, cost, trace, rate, slo, settings, ns.jobs,
                         progress)
    print()
    print(format_table(evaluations, rate, slo, ns.top))
    if ns.plot:
        from .plot import plot_tune

        best = evaluations[0]
        best_rate = best.max_rate or rate
        run = simulate(best.setting.engine_config(config), best.setting.num_kv_blocks,
                       max_model_len, cost, trace.scaled(best_rate / rate))
        plot_tune(evaluations, rate, slo, ns.plot, run, best_rate=best_rate,
                  title=f"tidal tune: {config.model.name} at {rate:g} req/s, "
                        f"{slo.describe()} (simulated)")
        print(f"plot written to {ns.plot}")
    _write_json(ns.result_file, {"command": "tune", "cost_model": cost_path,
                                 "request_rate": rate, "slo": vars(slo),
                                 "settings": evaluations_to_json(evaluations)})
    return 0


def _warn_outside_profile(cost: StepCostModel, seqs: list[int], tokens: list[int]) -> None:
    max_reqs, max_tokens = cost.info.get("max_decode_reqs"), cost.info.get("max_prefill_tokens")
    if max_reqs and max(seqs) > max_reqs or max_tokens and max(tokens) > max_tokens:
        print(f"note: the grid goes beyond the profiled shapes (up to {max_reqs} decode "
              f"requests and {max_tokens} tokens a step); step times there are extrapolated. "
              "Profile with --max-decode-reqs / --max-prefill-tokens to cover them.",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
