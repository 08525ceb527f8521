#!/usr/bin/env bash
# Install what the Mooncake and NIXL tiers need into .venv (created by tools/setup-venv.sh):
# the pinned wheels of requirements/remote.txt (--no-deps: their dependencies are in the
# vLLM lock) and Debian's libibverbs1, which Mooncake's extension and mooncake_master link
# against even for TCP. Idempotent: a stamp of the inputs' hashes skips the pip step when
# nothing changed. Output goes to .venv/kvtier-remote-setup.log; errors are shown.
#
# Choices (see requirements/remote.txt): the non-CUDA Mooncake build, so no libcudart and no
# libcuda stub are needed on machines without a GPU; libibverbs1 without its recommended
# provider plugins (ibverbs-providers), which nothing here uses. Where those plugins are
# installed, a process that used NIXL-UCX can crash at exit unless UCX_MODULES=^ib: the
# NIXL tests set it themselves; a CPU-only deployment should too.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "setup-remote: no .venv; run tools/setup-venv.sh first" >&2
  exit 1
fi
log=.venv/kvtier-remote-setup.log  # inside .venv: ignored by git with it
: > "$log"

# 1. libibverbs.so.1 (system library; root and Debian's apt needed, otherwise the
#    Mooncake tests skip and say why).
if ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null; then  # no -q: with pipefail, ldconfig's SIGPIPE would fail it
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup-remote: installing libibverbs1 (Debian)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1; } \
      >> "$log" 2>&1 || { tail -20 "$log"; echo "setup-remote: apt-get install libibverbs1 failed (see $log)" >&2; exit 1; }
  else
    echo "setup-remote: libibverbs.so.1 is missing and cannot be installed here (need root and apt-get);" \
         "Mooncake tests will be skipped" >&2
  fi
fi

# 2. The wheels.
want=$(cat requirements/remote.txt "$0" | sha256sum | cut -c1-16)
stamp=.venv/.kvtier-remote-stamp
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup-remote: installing requirements/remote.txt (Mooncake, NIXL; ~200 MB, log in $log)"
  {
    # The CUDA build of Mooncake ships the same files as the non-CUDA one: never keep both.
    if .venv/bin/python -m pip show -q mooncake-transfer-engine >/dev/null 2>&1; then
      .venv/bin/python -m pip uninstall -y mooncake-transfer-engine
    fi
    .venv/bin/python -m pip install --no-deps -r requirements/remote.txt
  } >> "$log" 2>&1 || { grep -v "is ignored: it is neither" "$log" | tail -30; echo "setup-remote: pip failed (see $log)" >&2; exit 1; }
fi

# 3. Check that both import (a missing system library shows up here, not in the tests).
if ! .venv/bin/python -c "import mooncake.store, nixl_cu12._api" >> "$log" 2>&1; then
  tail -5 "$log"
  echo "setup-remote: mooncake.store or nixl_cu12 does not import (see $log)" >&2
  if [ "$(id -u)" = 0 ]; then
    exit 1  # as root everything was installable: this is a real failure
  fi
else
  echo "$want" > "$stamp"
fi
