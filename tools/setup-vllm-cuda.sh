#!/usr/bin/env bash
# Fetch the CUDA vLLM wheel's sources for the API check (tests/connector/test_api_compat_cuda.py,
# tools/check_vllm_api.py), without installing it: pip download, then extract the few
# packages the check reads (~4 MB of Python files) into .venv/kvtier-vllm-cuda, and delete
# the ~340 MB wheel. Idempotent: a stamp of this script's hash skips the work when present.
#
# Never fails the run: if the download fails or exceeds its time limit, the reason goes to
# .venv/kvtier-vllm-cuda.skip, the API check is skipped with that reason, and the next run
# tries again.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.33.0   # the CUDA release the plugin is written for (README's compatibility line)
# Folders extracted (their .py files, not sub-folders): the connector API, the scheduler-side
# types, and every module the plugin imports from vllm.
FOLDERS="vllm vllm/config vllm/platforms vllm/distributed vllm/distributed/kv_transfer
  vllm/distributed/kv_transfer/kv_connector vllm/distributed/kv_transfer/kv_connector/v1
  vllm/v1 vllm/v1/core vllm/v1/core/sched vllm/v1/metrics vllm/v1/attention/backends"
if [ ! -x .venv/bin/python ]; then
  echo "setup-vllm-cuda: no .venv; run tools/setup-venv.sh first" >&2
  exit 1
fi
dest=.venv/kvtier-vllm-cuda
skip=.venv/kvtier-vllm-cuda.skip
want=$(sha256sum < "$0" | cut -c1-16)
if [ "$(cat "$dest/.stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setup-vllm-cuda: fetching the vllm $VERSION wheel for the API check (~340 MB, not installed)"
tmp=$(mktemp -d .venv/kvtier-vllm-cuda.tmp.XXXXXX)  # beside $dest: the final mv is a rename
trap 'rm -rf "$tmp"' EXIT
log=$tmp/pip.log
# --no-deps: nothing else is needed; --no-cache-dir: the wheel is deleted after extraction.
if ! timeout 600 .venv/bin/python -m pip download --no-deps --only-binary=:all: --no-cache-dir \
    --timeout 30 --retries 2 -d "$tmp/wheel" "vllm==$VERSION" > "$log" 2>&1; then
  reason=$(grep -v "is ignored: it is neither" "$log" | grep -E "^ERROR" | tail -1)
  if grep -qE "NewConnectionError|ConnectTimeout|ReadTimeout|name resolution|Network is unreachable" "$log"; then
    reason="the package index is unreachable (${reason:-no answer})"
  fi
  [ -n "$reason" ] || reason="pip download did not finish within 600 s"
  echo "pip download vllm==$VERSION failed: $reason" > "$skip"
  echo "setup-vllm-cuda: $(cat "$skip"); the vllm $VERSION API check will be skipped" >&2
  exit 0
fi
wheel=$(ls "$tmp"/wheel/vllm-"$VERSION"-*.whl)
.venv/bin/python - "$wheel" "$tmp/src" $FOLDERS <<'EOF'
import posixpath, sys, zipfile
from pathlib import Path
wheel, out, folders = sys.argv[1], Path(sys.argv[2]), set(sys.argv[3:])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.endswith(".py") and posixpath.dirname(name) in folders:
            z.extract(name, out)
(out / "KVTIER-EXTRACTED").write_text("\n".join(sorted(folders)) + "\n")
(out / "KVTIER-WHEEL").write_text(Path(wheel).name + "\n")
EOF
echo "$want" > "$tmp/src/.stamp"
rm -rf "$dest" "$skip"
mv "$tmp/src" "$dest"
