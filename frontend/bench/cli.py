"""`tidal bench {serve,sweep,throughput,latency,overhead,chaos}`: flags and dispatch.

`add_bench_args(parser)` adds the subcommands to the `bench` parser of `tidal`'s CLI;
`run_bench(ns)` runs the chosen one and returns the exit status. Every subcommand prints a
report and can write its results as JSON (`--result-file PATH`, or `--save-result` to write
into `--result-dir` under a generated name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

from .datasets import DATASET_NAMES, DatasetConfig, build_dataset, \
    load_tokenizer
from .metrics import format_report, parse_goodput, parse_percentiles, \
    results_to_json


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Add the bench subcommands (`ns.bench_command` names the chosen one)."""
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve,sweep,throughput,latency,"
                                "overhead,chaos}", required=True)
    serve = sub.add_parser("serve", help="online: stream requests to an OpenAI-compatible server")
    _add_client_args(serve)
    sweep = sub.add_parser("sweep", help="online: the serve benchmark at several request rates")
    _add_client_args(sweep)
    sweep.add_argument("--request-rates", default="1,2,4,inf",
                       help="comma-separated request rates to run in order (default: 1,2,4,inf)")
    throughput = sub.add_parser("throughput", help="offline: the workload through LLM, and "
                                "through transformers in the same run")
    _add_offline_args(throughput, with_dataset=True)
    throughput.add_argument("--hf-backends", default="static,continuous",
                            help="transformers baselines to run too: static, continuous, both "
                                 "comma-separated, or none (default: static,continuous)")
    throughput.add_argument("--hf-max-batch-size", type=int, default=16,
                            help="batch size of the static transformers baseline (default: 16)")
    latency = sub.add_parser("latency", help="offline: one batch, repeated")
    _add_offline_args(latency, with_dataset=False)
    _add_latency_args(latency)
    overhead = sub.add_parser("overhead", help="offline: engine steps/s on a one-layer, "
                              "hidden-64 model, async scheduling on and off")
    _add_offline_args(overhead, with_dataset=False)
    overhead.add_argument("--batch-size", type=int, default=8, help="requests per batch (8)")
    overhead.add_argument("--output-len", type=int, default=128, help="tokens each (128)")
    overhead.add_argument("--num-iters", type=int, default=3, help="timed batches (3)")
    from .chaos import add_chaos_args

    add_chaos_args(sub.add_parser("chaos", help="soak a live tidal serve while killing its "
                                  "workers, engine core and HTTP processes"))


def add_dataset_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
    """The workload flags (dataset, lengths, prefixes; `--seed` when `with_seed`)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", "--dataset", choices=DATASET_NAMES, default="random",
                   help="random, sharegpt-like, shared-prefix or jsonl (default: random)")
    g.add_argument("--dataset-path", default=None, help="jsonl: the file")
    g.add_argument("--num-prompts", type=int, default=100, help="requests (default: 100)")
    g.add_argument("--random-input-len", "--input-len", type=int, default=128,
                   help="random: mean prompt tokens; shared-prefix: suffix tokens (128)")
    g.add_argument("--random-output-len", "--output-len", type=int, default=64,
                   help="output tokens (random mean, shared-prefix, jsonl default) (64)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform within +-ratio of the means (default: 0)")
    g.add_argument("--random-prefix-len", "--prefix-len", type=int, default=0,
                   help="random, shared-prefix: common prefix tokens (default: 0)")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix: number of distinct prefixes (default: 1)")
    g.add_argument("--sharegpt-max-input-len", type=int, default=1024,
                   help="sharegpt-like: longest prompt kept (default: 1024)")
    g.add_argument("--sharegpt-max-total-len", type=int, default=2048,
                   help="sharegpt-like: longest prompt + output kept (default: 2048)")
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="workload and arrival seed (0)")


def _add_result_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument("--result-file", default=None, help="write the results as JSON here")
    g.add_argument("--save-result", action="store_true",
                   help="write the results as JSON into --result-dir under a generated name")
    g.add_argument("--result-dir", default=".", help="directory for --save-result (default: .)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--host", default="127.0.0.1", help="without --base-url (127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="without --base-url (8000)")
    g.add_argument("--endpoint", default="/v1/completions", help="(default: /v1/completions)")
    g.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer folder for token-exact prompts (default: --model if "
                        "it is a local folder)")
    g = p.add_argument_group("traffic")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default: inf, all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrival gaps: 1 Poisson, <1 burstier (default: 1)")
    g.add_argument("--max-concurrency", type=int, default=None, help="client-side cap")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests first (0)")
    g.add_argument("--ignore-eos", action="store_true", help="force max_tokens output tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    g.add_argument("--extra-body", type=json.loads, default={},
                   help="JSON object merged into every request body")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds (600)")
    g.add_argument("--ready-check-timeout-sec", type=float, default=60.0,
                   help="wait this long for the server to answer /v1/models (60)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000")
    g.add_argument("--metric-percentiles", default="50,90,99",
                   help="latency percentiles to report (default: 50,90,99)")
    g.add_argument("--metrics-interval", type=float, default=0.25,
                   help="seconds between /metrics samples for the timeline (0.25)")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figure here")
    g.add_argument("--save-detailed", action="store_true",
                   help="include every request's measurements in the JSON")
    add_dataset_args(p, with_seed=True)
    _add_result_args(p)


def _add_offline_args(p: argparse.ArgumentParser, with_dataset: bool) -> None:
    from ...engine_core.args import add_engine_args

    add_engine_args(p)
    p.add_argument("--random-weights", default=None, metavar="HIDDEN,LAYERS",
                   help="benchmark a random-weight Llama of this shape built with MODEL's "
                        "tokenizer (cached under --random-weights-dir)")
    p.add_argument("--random-weights-dir", default=os.path.expanduser("~/.cache/tidal/bench"),
                   help="where --random-weights models are kept")
    if with_dataset:
        add_dataset_args(p, with_seed=False)
    _add_result_args(p)


def _add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (32)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (128)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per batch (8)")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed batches (2)")
    p.add_argument("--num-iters", type=int, default=5, help="timed batches (5)")


def run_bench(ns: argparse.Namespace) -> int:
    """Run `ns.bench_command`; 0 on success, 1 when requests failed, 2 on bad arguments."""
    handlers = {"serve": _run_serve, "sweep": _run_sweep, "throughput": _run_throughput,
                "latency": _run_latency, "overhead": _run_overhead, "chaos": _run_chaos}
    try:
        return handlers[ns.bench_command](ns)
    except (ValueError, TimeoutError) as e:
        print(f"tidal bench {ns.bench_command}: {e}", file=sys.stderr)
        return 2


def _run_chaos(ns: argparse.Namespace) -> int:
    from .chaos import chaos_config_from_args, run_chaos

    text, status = run_chaos(chaos_config_from_args(ns), ns.log)
    print(text)
    return status


def dataset_config_from_args(ns: argparse.Namespace) -> DatasetConfig:
    """The workload the flags describe (ValueError naming the field on bad values)."""
    return DatasetConfig(
        name=ns.dataset_name, num_prompts=ns.num_prompts, seed=ns.seed,
        input_len=ns.random_input_len, output_len=ns.random_output_len,
        range_ratio=ns.random_range_ratio, prefix_len=ns.random_prefix_len,
        num_prefixes=ns.num_prefixes, max_input_len=ns.sharegpt_max_input_len,
        max_total_len=ns.sharegpt_max_total_len, path=ns.dataset_path)


def serve_config_from_args(ns: argparse.Namespace):
    """The client configuration the flags describe."""
    from .serve import ServeConfig

    base_url = ns.base_url or f"http://{ns.host}:{ns.port}"
    return ServeConfig(
        base_url=base_url, endpoint=ns.endpoint, model=ns.model, request_rate=ns.request_rate,
        burstiness=ns.burstiness, max_concurrency=ns.max_concurrency,
        num_warmups=ns.num_warmups, ignore_eos=ns.ignore_eos, temperature=ns.temperature,
        seed=ns.seed, request_timeout_s=ns.request_timeout,
        ready_timeout_s=ns.ready_check_timeout_sec, metrics_interval_s=ns.metrics_interval,
        extra_body=ns.extra_body, disable_tqdm=ns.disable_tqdm,
        goodput_slos=parse_goodput(ns.goodput),
        percentiles=parse_percentiles(ns.metric_percentiles))


def _client_workload(ns: argparse.Namespace):
    tokenizer = load_tokenizer(ns.tokenizer or (ns.model if ns.model and
                                                os.path.isdir(ns.model) else None))
    return build_dataset(dataset_config_from_args(ns), tokenizer), tokenizer is not None


def _run_serve(ns: argparse.Namespace) -> int:
    from .serve import run_serve_benchmark

    config = serve_config_from_args(ns)
    requests, exact = _client_workload(ns)
    run = asyncio.run(run_serve_benchmark(requests, config))
    summary, results = run["summary"], run["results"]
    summary["dataset"] = _dataset_json(ns, exact)
    print(format_report(summary))
    if ns.plot:
        from .plot import plot_serve

        plot_serve(summary, results, ns.plot)
        print(f"plot written to {ns.plot}")
    document = {"command": "serve", "summary": summary}
    if ns.save_detailed:
        document["requests"] = results_to_json(results)
    write_result(ns, document)
    return 0 if summary["failed"] == 0 else 1


def _run_sweep(ns: argparse.Namespace) -> int:
    from .sweep import format_sweep_table, parse_rates, run_sweep

    rates = parse_rates(ns.request_rates)
    config = serve_config_from_args(ns)
    requests, exact = _client_workload(ns)
    rows = run_sweep(requests, config, rates)
    print(format_sweep_table(rows))
    if ns.plot:
        from .plot import plot_sweep

        plot_sweep(rows, ns.plot)
        print(f"plot written to {ns.plot}")
    write_result(ns, {"command": "sweep", "dataset": _dataset_json(ns, exact), "runs": rows})
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _dataset_json(ns: argparse.Namespace, exact: bool) -> dict:
    config = dataset_config_from_args(ns)
    return dict(vars(config), token_exact_prompts=exact)


def write_result(ns: argparse.Namespace, document: dict) -> str | None:
    """Write `document` as JSON where the flags say; returns the path, or None."""
    path = ns.result_file
    if path is None and ns.save_result:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(ns.result_dir, f"tidal-bench-{document['command']}-{stamp}.json")
    if path is None:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, default=_json_default)
    print(f"results written to {path}")
    return path


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


def _engine_config(ns: argparse.Namespace):
    """The engine config of an offline subcommand (MODEL replaced by --random-weights)."""
    import dataclasses

    from ...engine_core.args import config_from_args
    from ...engine_core.model_files import prepare_model

    if not (ns.model_tag or ns.model):
        from ..llm import default_model

        ns.model = default_model()  # the bundled demo model, as LLM() does
    config = prepare_model(config_from_args(ns))  # a Hub id: fetched once, here
    if ns.random_weights:
        model_dir = random_weights_model(ns.random_weights, config.model.model,
                                         ns.random_weights_dir)
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, model=model_dir, tokenizer=None))
    return config


def random_weights_model(spec: str, tokenizer_src: str, cache_dir: str) -> str:
    """'256,4' -> the folder of a random-weight Llama of hidden 256, 4 layers (built once)."""
    from .offline import make_random_llama

    try:
        hidden, layers = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"random_weights: expected HIDDEN,LAYERS, got {spec!r}") from None
    if hidden < 1 or layers < 1:
        raise ValueError(f"random_weights: sizes must be >= 1, got {spec!r}")
    dst = os.path.join(cache_dir, f"llama-h{hidden}-l{layers}-{_slug(tokenizer_src)}")
    return make_random_llama(dst, tokenizer_src, hidden, layers)


def _slug(path: str) -> str:
    return os.path.basename(os.path.normpath(path)).replace(os.sep, "_") or "model"


def _run_throughput(ns: argparse.Namespace) -> int:
    from . import hf_baselines, offline

    config = _engine_config(ns)
    backends = _parse_hf_backends(ns.hf_backends)
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
    if tokenizer is None:
        raise ValueError(f"model {config.model.model!r}: no tokenizer to build the workload")
    requests = build_dataset(dataset_config_from_args(ns), tokenizer)
    host = host_info()
    print(f"model {config.model.model}: {offline.count_parameters(config.model.model):,} "
          f"parameters; {len(requests)} requests ({ns.dataset_name}); host: "
          f"{host['cpu_count']} CPUs, load average {host.get('loadavg_1m_5m_15m')}")
    results = [offline.run_tidal_throughput(config, requests, use_tqdm=not ns.disable_tqdm)]
    print(offline.format_throughput(results, {}), flush=True)  # each figure as soon as known
    if backends:
        model = hf_baselines.load_hf_model(config.model.model, config.model.dtype)
        if "static" in backends:
            results.append(hf_baselines.run_hf_static(model, requests, ns.hf_max_batch_size))
            print(offline.format_throughput(results[-1:], {}), flush=True)
        if "continuous" in backends and hf_baselines.has_hf_continuous_batching(model):
            results.append(hf_baselines.run_hf_continuous(model, requests))
    print("--- summary ---")
    ratios = offline.compare_to_baselines(results[0], results[1:])
    print(offline.format_throughput(results, ratios))
    write_result(ns, {"command": "throughput", "model": config.model.model, "host": host,
                      "dataset": dict(vars(dataset_config_from_args(ns))),
                      "results": results, "ratios": ratios})
    return 0


def host_info() -> dict:
    """CPU count and load, so readers can judge figures from a shared machine."""
    import platform

    info = {"cpu_count": os.cpu_count(), "platform": platform.platform()}
    if hasattr(os, "getloadavg"):
        info["loadavg_1m_5m_15m"] = list(os.getloadavg())
    return info


def _parse_hf_backends(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if names == ["none"]:
        return []
    if not names or any(n not in ("static", "continuous") for n in names):
        raise ValueError(f"hf_backends: expected static, continuous or none, got {text!r}")
    return names


def _run_latency(ns: argparse.Namespace) -> int:
    from . import offline

    config = _engine_config(ns)
    result = offline.run_latency(config, ns.input_len, ns.output_len, ns.batch_size,
                                 ns.num_iters_warmup, ns.num_iters, ns.seed)
    print(offline.format_latency(result))
    write_result(ns, {"command": "latency", "model": config.model.model, **result})
    return 0


def _run_overhead(ns: argparse.Namespace) -> int:
    from . import offline

    if not ns.random_weights:
        ns.random_weights = "64,1"
    config = _engine_config(ns)
    result = offline.run_overhead(config, ns.batch_size, ns.output_len, ns.num_iters)
    print(offline.format_overhead(result))
    write_result(ns, {"command": "overhead", "model": config.model.model, **result})
    return 0
