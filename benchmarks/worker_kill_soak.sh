#!/bin/bash
# Issue 39's soak, kept: 10 minutes of Poisson traffic against `tidal serve` (the demo model,
# two HTTP processes) with a worker rank SIGKILLed every minute. Every answer must be complete
# and equal to the fault-free greedy run; nothing lost, no KV block left at idle, no orphan.
#   bash benchmarks/worker_kill_soak.sh [extra `tidal bench chaos` flags]
set -u
cd "$(dirname "$0")/.."
echo "commit $(git rev-parse --short HEAD) $(date -u '+%Y-%m-%d %H:%M:%S') load $(cut -d' ' -f1-3 /proc/loadavg)"
exec tidal bench chaos --duration 600 --request-rate 28 --faults worker-kill --fault-interval 60 \
  --calm 0.1 --max-tokens 16 "$@"
