"""Ready time of two checkouts, interleaved (issue 36 item 4: old commit against new on a
shared machine, where only runs taken side by side compare).

    python benchmarks/ready_time_ab.py OLD_PYTHONPATH NEW_PYTHONPATH RUNS [MODEL ...]

Each PYTHONPATH makes `import tidal` load one checkout (a worktree's `.devpkg`, say). For each
model ("" is the bundled demo model) one warm-up run of each checkout, not counted, then
RUNS rounds of both, in alternating order, each timed as `ready_time.ready_s` does (command
to first token). Prints the median and least of each, with `uptime` before and after.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ready_time  # noqa: E402


def _ready_s(pythonpath: str, model: str) -> float:
    os.environ["PYTHONPATH"] = pythonpath  # the child's `import tidal`
    return ready_time.ready_s(model)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    old, new, runs, models = argv[0], argv[1], int(argv[2]), argv[3:] or [""]
    for model in models:
        print(_uptime(), flush=True)
        for tree in (old, new):
            _ready_s(tree, model)  # warm the page cache and compile caches
        seconds: dict[str, list[float]] = {old: [], new: []}
        for i in range(runs):
            for tree in ((old, new) if i % 2 == 0 else (new, old)):
                seconds[tree].append(_ready_s(tree, model))
        name = os.path.basename(model) or "demo model"
        for tree, label in ((old, "old"), (new, "new")):
            r = seconds[tree]
            print(f"{name} {label}: median {statistics.median(r):.2f} s, least {min(r):.2f} s "
                  f"(runs {', '.join(f'{x:.2f}' for x in r)})", flush=True)
        print(_uptime(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
