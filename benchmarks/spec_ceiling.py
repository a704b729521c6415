"""How far one stream's speculation could go on this machine: the adaptive policy replayed
offline over real outputs against measured step times, beside fixed draft counts, the best
fixed draft count for each match length (fit on the same outputs: the best any one count
per match length does; a policy that adapts as it goes may still beat it) and an oracle
that knows each draft's accepted run.

    python benchmarks/spec_ceiling.py MODEL_FOLDER [--prompts 48] [--max-tokens 96]
        [--method suffix] [--ceiling 4] [--most 16] [--costs measured|flat|1,1.3,...]
        [--workloads copy chat]

1. The engine without speculation writes greedy answers to the first `--prompts` prompts of
   each of spec_decode.py's workloads (its copy-heavy and chat tasks).
2. Each answer is walked token by token with the method's proposer (requests in order, so
   `suffix` finds the earlier answers in its store as it would in the engine): at every
   position the draft of up to `--most` tokens, the match it came from and how many of its
   tokens the answer then has (the accepted run: greedy verification keeps exactly those).
3. The cost of a decode step of 1 + k rows relative to a 1-row step: measured in this
   process (verify_step.py's worker, one request at ~200 tokens, the least of interleaved
   steps), or `flat` (every row free: what a memory-bound GPU step is close to), or given.
4. Each policy walks every answer: a step with k drafts yields min(accepted, k) + 1 tokens
   and costs cost[k]; the figure is tokens over cost (the speed-up against no drafts with
   the model's time only: the proposer's and the engine's own time left out). `adaptive`
   is `spec_decode.AdaptivePolicy` itself, fed each step's outcome and measured time as
   the engine core feeds it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def answers(model: str, workloads: list[str], prompts: int, max_tokens: int) -> dict:
    """{workload: [(prompt ids, greedy answer ids)]} from the engine without speculation."""
    import spec_decode
    from tidal.frontend import LLM, SamplingParams

    tasks = {"copy": spec_decode.COPY_TASKS, "chat": spec_decode.CHAT_TASKS}
    llm = LLM(model, kv_cache_memory="256MiB", max_model_len=1024)
    try:
        out = {}
        for name in workloads:
            convs = [[{"role": "user", "content": spec_decode.prompt(tasks[name], i)}]
                     for i in range(prompts)]
            done = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                            use_tqdm=False)
            out[name] = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids))
                         for o in done]
        return out
    finally:
        llm.close()


def walk(pairs: list, method: str, most: int) -> list[list[tuple[int, int, int]]]:
    """Per answer, per decode position (the first token is the prefill's): (match, draft
    length, accepted run) of the proposer's draft of up to `most` tokens."""
    from tidal.engine_core.proposers import make_proposer
    from tidal.engine_core.spec_decode import SpeculativeConfig

    proposer = make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=most))
    walks = []
    for i, (prompt, answer) in enumerate(pairs):
        positions = []
        for p in range(1, len(answer)):
            draft = proposer.propose(f"r{i}", prompt + answer[:p], most)
            run = 0
            for drafted, actual in zip(draft.tokens, answer[p:]):
                if drafted != actual:
                    break
                run += 1
            positions.append((draft.match, len(draft.tokens), run))
        proposer.finished(f"r{i}", prompt + answer, len(prompt))
        walks.append(positions)
    return walks


def measured_costs(model: str, most: int, rounds: int = 12) -> list[float]:
    """cost[k]: a step verifying k drafts over a step of one row, k = 0 .. most (the least
    of `rounds` interleaved steps each: on a shared 2-vCPU VM the median of a handful
    still moves 1.5x between runs)."""
    from verify_step import stepper

    run = stepper(model)
    for k in range(most + 1):
        run(k)  # the first step of each row count builds its kernels' tables
    least = [float("inf")] * (most + 1)
    for _ in range(rounds):
        for k in range(most + 1):
            least[k] = min(least[k], run(k))
    return [t / least[0] for t in least]


def replay(walks, cost: list[float], policy_for) -> tuple[float, float]:
    """(tokens a step, tokens over cost) of a policy over every answer. `policy_for()` gives
    a fresh `choose(position) -> k` and `learn(k, accepted, match)` pair for the run (one
    engine: it keeps what it learned from one answer to the next)."""
    choose, learn = policy_for()
    tokens = steps = spent = 0.0
    for positions in walks:
        p = 0
        while p < len(positions):
            match, available, run = positions[p]
            k = min(choose(positions, p), available, len(positions) - p - 1,
                    len(cost) - 1)
            accepted = min(run, k)
            learn(k, accepted, match)
            tokens += accepted + 1
            spent += cost[k]
            steps += 1
            p += accepted + 1
    return tokens / steps, tokens / spent


def fixed(k: int):
    return lambda: ((lambda positions, p: k), lambda k, a, m: None)


def oracle():
    return (lambda positions, p: positions[p][2]), (lambda k, a, m: None)


def best_per_match(walks, cost: list[float]):
    """The draft count that pays most for each match length over these very answers."""
    runs = collections.defaultdict(list)
    for positions in walks:
        for match, available, run in positions:
            runs[match].append(run)

    def pays(k, rs):
        return sum(min(r, k) + 1 for r in rs) / (len(rs) * cost[k])
    best = {m: max(range(len(cost)), key=lambda k: pays(k, rs)) for m, rs in runs.items()}
    return lambda: ((lambda positions, p: best.get(positions[p][0], 0)),
                    lambda k, a, m: None)


def adaptive(ceiling: int, cost: list[float], unit_s: float = 0.007):
    """`AdaptivePolicy` as the engine core drives it for one decoding request: asked
    whether to run the proposer, then how many of its drafts to verify, then told the
    outcome and the step's time (cost x `unit_s`: only ratios matter to it)."""
    def make():
        from tidal.engine_core.spec_decode import AdaptivePolicy, CostTerms

        policy = AdaptivePolicy(ceiling, CostTerms())
        terms = policy.terms

        def choose(positions, p):
            most = min(ceiling, len(positions) - p - 1)
            if most <= 0:
                return 0
            best = [(most, 200 + p, policy.best_probs(ceiling))]
            if not policy.ask(best, 0.0, 2048, 1)[0]:
                return 0
            policy.observe_proposer(20e-6, 1)
            match, available, _ = positions[p]
            if not available:
                return 0
            n = min(available, most)
            return policy.choose([(n, 200 + p, policy.draft_probs(match, n))],
                                 terms.intercept, 0.0, 2048, 1)[0]

        def learn(k, accepted, match):
            if k:
                policy.record(k, accepted, match)
            policy.observe_step(1 + k, cost[k] * unit_s)
        return choose, learn
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default="suffix", choices=["suffix", "ngram"])
    parser.add_argument("--ceiling", type=int, nargs="+", default=[4, 8],
                        help="the adaptive policy's num_speculative_tokens (each replayed)")
    parser.add_argument("--most", type=int, default=16, help="the longest draft walked")
    parser.add_argument("--costs", default="measured")
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat"],
                        choices=["copy", "chat"])
    parser.add_argument("--answers", help="a JSON file of answers to reuse (written if "
                        "missing)")
    args = parser.parse_args()
    if args.answers and os.path.exists(args.answers):
        pairs = json.load(open(args.answers))
    else:
        pairs = answers(args.model, args.workloads, args.prompts, args.max_tokens)
        if args.answers:
            json.dump(pairs, open(args.answers, "w"))
    if args.costs == "measured":
        cost = measured_costs(args.model, args.most)
    elif args.costs == "flat":
        cost = [1.0] * (args.most + 1)
    else:
        cost = [float(c) for c in args.costs.split(",")]
    print(f"step cost by drafts verified (1 = a 1-row step; {args.costs}): "
          + " ".join(f"{k}:{c:.2f}" for k, c in enumerate(cost)))
    print(f"{args.method}, {args.prompts} answers of up to {args.max_tokens} tokens per "
          "workload, greedy; tokens a step / speed-up (model time only)")
    policies = {f"fixed {k}": fixed(k) for k in (1, 2, 3, 4, 6, 8) if k < len(cost)}
    for ceiling in args.ceiling:
        policies[f"adaptive, ceiling {ceiling}"] = adaptive(ceiling, cost)
    print(f"{'policy':<34}" + "".join(f"{w:>18}" for w in args.workloads))
    walks = {w: walk(pairs[w], args.method, args.most) for w in args.workloads}
    rows = list(policies.items())
    rows.append(("best k per match length (fit)", None))
    rows.append(("oracle (knows each run)", oracle))
    for name, make in rows:
        cells = []
        for w in args.workloads:
            make_w = make or best_per_match(walks[w], cost)
            per_step, speed = replay(walks[w], cost, make_w)
            cells.append(f"{per_step:6.2f} / {speed:5.2f}x")
        print(f"{name:<34}" + "".join(f"{c:>18}" for c in cells))
    runs = [r for w in args.workloads for positions in walks[w] for _, _, r in positions]
    print(f"accepted runs of the longest drafts: median {statistics.median(runs):.0f}, "
          f"{sum(r == 0 for r in runs) / len(runs):.0%} zero")


if __name__ == "__main__":
    main()
