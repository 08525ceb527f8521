#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU. Run from the repository root:
#
#     bash bench/gpu_check.sh
#
# 1. nvidia-smi;
# 2. a Python with the CUDA build of vLLM: the current python if `import vllm` works there
#    with CUDA, else .venv-gpu (reused if it works, else created with `pip install vllm`),
#    plus this package (`pip install -e . --no-deps`; PYTHONPATH as a fallback);
# 3. bench/cpu_tier_throughput.py --device cuda: GPU<->pinned-host block copies through our
#    copy engine vs one plain cudaMemcpyAsync of the same bytes;
# 4. pytest tests/integration/test_gpu_e2e.py (copy engine on CUDA + a real vLLM engine on CUDA), with
#    KVTIER_REQUIRE_GPU=1 so it fails instead of skipping without a GPU.
#
# Everything lands in bench/results/ (gpu_check_*.log, cpu_tier_throughput_cuda.json,
# gpu_e2e_junit.xml, gpu_check_summary.txt). Every step has a timeout and the whole run
# is capped at ~8 minutes (GPU_CHECK_BUDGET_S, default 470). Exits non-zero if any step
# fails. Env: PYTHON (interpreter to try first, default python3), GPU_VENV (.venv-gpu).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
RESULTS="$ROOT/bench/results"
mkdir -p "$RESULTS"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
GPU_VENV="${GPU_VENV:-$ROOT/.venv-gpu}"
SUMMARY="$RESULTS/gpu_check_summary.txt"
START=$SECONDS
FAILED=()
: >"$SUMMARY"

log() { echo "[gpu_check $(($SECONDS - START))s] $*" | tee -a "$SUMMARY"; }

# Seconds a step may take: at most $1, and never more than what is left of the budget
# minus $2 (time reserved for the steps after it). At least 10.
step_timeout() {
  local want=$1 reserve=${2:-0} left
  left=$((BUDGET_S - (SECONDS - START) - reserve))
  if ((left < want)); then want=$left; fi
  if ((want < 10)); then want=10; fi
  echo "$want"
}

# run_step NAME TIMEOUT CMD...: runs CMD with a timeout, output to the terminal and to
# bench/results/gpu_check_NAME.log; records a failure instead of exiting.
run_step() {
  local name=$1 secs=$2 rc=0
  shift 2
  log "step $name (timeout ${secs}s): $*"
  timeout --kill-after=15 "$secs" "$@" 2>&1 | tee "$RESULTS/gpu_check_$name.log" || rc=$?
  if ((rc == 0)); then
    log "step $name: ok"
  else
    if ((rc == 124 || rc == 137)); then
      log "step $name: TIMED OUT after ${secs}s"
    else
      log "step $name: FAILED (rc=$rc)"
    fi
    FAILED+=("$name")
  fi
  return 0
}

finish() {
  log "done in $((SECONDS - START))s"
  if ((${#FAILED[@]})); then
    log "FAILED: ${FAILED[*]}"
    exit 1
  fi
  log "ALL OK"
  exit 0
}

# ---- 1. the GPU --------------------------------------------------------------------
run_step nvidia_smi 30 nvidia-smi
if [[ " ${FAILED[*]} " == *" nvidia_smi "* ]]; then
  log "no working nvidia-smi: not a GPU machine (or no driver); stopping"
  finish
fi

# ---- 2. a Python with CUDA vLLM ----------------------------------------------------
CHECK_PY='import torch, vllm; assert torch.cuda.is_available(), "torch has no CUDA"; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
PY=""
for cand in "${PYTHON:-python3}" "$GPU_VENV/bin/python"; do
  if command -v "$cand" >/dev/null 2>&1 && timeout 120 "$cand" -c "$CHECK_PY" 2>/dev/null; then
    PY=$(command -v "$cand")
    log "using $PY (vllm with CUDA already importable)"
    break
  fi
done

if [[ -z "$PY" ]]; then
  log "no python with CUDA vllm: installing vllm into $GPU_VENV"
  # Leave ~3.5 min for the benchmark and the tests.
  secs=$(step_timeout 330 210)
  if [[ ! -x "$GPU_VENV/bin/python" ]]; then
    if command -v uv >/dev/null 2>&1; then
      run_step venv 60 uv venv --seed --python "${PYTHON:-python3}" "$GPU_VENV"
    else
      run_step venv 60 "${PYTHON:-python3}" -m venv "$GPU_VENV"
    fi
  fi
  if command -v uv >/dev/null 2>&1; then
    run_step install_vllm "$secs" uv pip install --python "$GPU_VENV/bin/python" vllm pytest
  else
    run_step install_vllm "$secs" "$GPU_VENV/bin/python" -m pip install --progress-bar off vllm pytest
  fi
  if [[ -x "$GPU_VENV/bin/python" ]] && timeout 120 "$GPU_VENV/bin/python" -c "$CHECK_PY"; then
    PY="$GPU_VENV/bin/python"
    log "using $PY"
  else
    log "vllm with CUDA is not importable from $GPU_VENV; stopping"
    FAILED+=(python_env)
    finish
  fi
fi

# This package: an editable install if pip allows it (entry point registered), and the
# repository on PYTHONPATH in any case (the tests name the connector's module path).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import vllm_kvtier, pytest' 2>/dev/null || ! "$PY" -m pip show vllm-kvtier >/dev/null 2>&1; then
  timeout 90 "$PY" -m pip install --progress-bar off -q -e . --no-deps >"$RESULTS/gpu_check_install_kvtier.log" 2>&1 ||
    log "note: pip install -e . --no-deps failed (see gpu_check_install_kvtier.log); using PYTHONPATH"
  "$PY" -c 'import pytest' 2>/dev/null ||
    timeout 90 "$PY" -m pip install --progress-bar off -q pytest >>"$RESULTS/gpu_check_install_kvtier.log" 2>&1 || true
fi
"$PY" - <<'EOF' 2>&1 | tee "$RESULTS/gpu_check_env.txt" || log "note: printing the environment failed"
import platform, torch, vllm, vllm_kvtier
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| vllm", vllm.__version__, "| vllm_kvtier", vllm_kvtier.__file__)
print("gpu", torch.cuda.get_device_name(0), "| count", torch.cuda.device_count())
EOF

export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

# ---- 3. copy bandwidth vs plain cudaMemcpyAsync ------------------------------------
run_step bench_cuda "$(step_timeout 120 150)" "$PY" bench/cpu_tier_throughput.py --device cuda \
  --json "$RESULTS/cpu_tier_throughput_cuda.json"

# ---- 4. tests on the GPU -----------------------------------------------------------
export KVTIER_REQUIRE_GPU=1
run_step pytest_gpu "$(step_timeout 330 0)" "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/integration/test_gpu_e2e.py --junitxml="$RESULTS/gpu_e2e_junit.xml"

finish
