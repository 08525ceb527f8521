#!/usr/bin/env bash
# The serving benchmark's peer, LMCache (requirements/bench-lmcache.txt), in a folder of its
# own, .venv-lmcache: `pip install --no-deps --target`, read by the engine's python through
# PYTHONPATH on the LMCache rows only, so .venv never changes. Its wheel's declared pins
# (numpy<=2.2.6, protobuf<7, cupy-cuda13x) conflict with .venv and the CPU multi-process path
# does not import them. Idempotent (a stamp of the requirements' hash). Exit 0 when ready;
# otherwise the reason on stderr (bench/serving.py then skips the lmcache row and says why).
set -euo pipefail
cd "$(dirname "$0")/.."
req=requirements/bench-lmcache.txt
dir=.venv-lmcache
stamp=$dir/kvtier-stamp
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || { echo "setup-lmcache-env: no .venv (run tools/setup-venv.sh first)" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir"
echo "setup-lmcache-env: installing $(grep -v '^#' "$req" | xargs) into $dir (--no-deps; about a minute)"
.venv/bin/pip install -q --no-deps --target "$dir" -r "$req" > "$dir/setup.log" 2>&1 \
  || { tail -20 "$dir/setup.log" >&2; echo "setup-lmcache-env: pip install failed (see $dir/setup.log)" >&2; exit 1; }
PYTHONPATH=$dir .venv/bin/python -c "import lmcache.integration.vllm.lmcache_mp_connector, lmcache.cli.main" \
  >> "$dir/setup.log" 2>&1 \
  || { tail -20 "$dir/setup.log" >&2; echo "setup-lmcache-env: LMCache does not import with .venv's packages (see $dir/setup.log)" >&2; exit 1; }
echo "$want" > "$stamp"
