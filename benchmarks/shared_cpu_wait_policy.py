"""Decode on a shared CPU: the tiny test model's two 480-token greedy requests through `LLM`,
timed; run it with and without OMP_WAIT_POLICY=PASSIVE beside other work (docs/performance.md,
"A shared CPU").

    python benchmarks/shared_cpu_wait_policy.py MODEL_FOLDER
"""

import sys
import time

from tidal import LLM, SamplingParams

with LLM(sys.argv[1], kv_cache_memory="8MiB") as llm:
    t = time.time()
    outs = llm.generate(["def"] * 2, SamplingParams(max_tokens=480, ignore_eos=True,
                                                    temperature=0), use_tqdm=False)
    print("tokens", sum(len(o.outputs[0].token_ids) for o in outs), "in",
          round(time.time() - t, 1), "s")
