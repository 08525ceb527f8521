#!/usr/bin/env bash
# Lint and type-check (make lint; .ci/run after the tests): ruff on the package, the tests
# and the benchmarks, mypy on the package. The tools are pinned in requirements/dev.txt and
# installed into .venv with --no-deps (idempotent). Prints nothing and exits 0 when clean.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup-venv.sh >/dev/null
.venv/bin/python -c "import ruff, mypy" 2>/dev/null \
  || .venv/bin/pip install -q --no-deps -r requirements/dev.txt >/dev/null 2>&1 \
  || { echo "lint: pip install -r requirements/dev.txt failed" >&2; exit 1; }
.venv/bin/python -m ruff check -q vllm_kvtier tests bench
.venv/bin/python -m mypy --no-error-summary vllm_kvtier
