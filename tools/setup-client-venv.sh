#!/usr/bin/env bash
# The benchmark clients' own environment, .venv-client (bench/serving.py's multi-turn client,
# NVIDIA AIPerf, pinned in requirements/bench-client.txt). Separate from .venv so a client's
# dependencies never change what the engine runs with. Idempotent (a stamp of the
# requirements' hash). Output: .venv-client/setup.log; errors are shown.
set -euo pipefail
cd "$(dirname "$0")/.."
req=requirements/bench-client.txt
stamp=.venv-client/kvtier-stamp
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
py=$(command -v python3.11 || command -v python3)
[ -x .venv-client/bin/python ] || "$py" -m venv .venv-client
echo "setup-client-venv: installing $(grep -v '^#' "$req" | xargs) into .venv-client (a few minutes the first time)"
.venv-client/bin/pip install -q -r "$req" > .venv-client/setup.log 2>&1 \
  || { tail -20 .venv-client/setup.log; echo "setup-client-venv: pip install failed (see .venv-client/setup.log)" >&2; exit 1; }
echo "$want" > "$stamp"
