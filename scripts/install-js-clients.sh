#!/usr/bin/env bash
# E2B's JavaScript SDKs for the tests that drive k3sys from JavaScript (tests/sandbox/js/: `e2b` and
# `@e2b/code-interpreter`, pinned in its package.json): Node.js and npm from Debian when missing, then
# the packages from npm's registry into .cache/js-clients/node_modules. Idempotent: a stamp holds the
# package.json's hash, so a cached re-run only compares it. Without Node.js the JavaScript tests skip.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "[install-js-clients] $*"; }
# shellcheck source=lib/apt.sh
source "$ROOT/scripts/lib/apt.sh"

if ! command -v npm >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "skipping: no npm, and installing Node.js needs root on a Debian-like Linux"
        exit 0
    fi
    apt_ensure nodejs npm
fi
DEST=$ROOT/.cache/js-clients
SRC=$ROOT/tests/sandbox/js/package.json
want=$(sha256sum "$SRC" | cut -d' ' -f1)
if [ "$(cat "$DEST/.stamp" 2>/dev/null)" = "$want" ] && [ -d "$DEST/node_modules/e2b" ]; then
    exit 0
fi
log "npm install $(node -e 'const d=require(process.argv[1]).dependencies; console.log(Object.entries(d).map(([k,v])=>k+"@"+v).join(" "))' "$SRC")"
mkdir -p "$DEST"
cp "$SRC" "$DEST/package.json"
(cd "$DEST" && npm install --no-audit --no-fund --ignore-scripts --no-package-lock --loglevel=error >/dev/null)
echo "$want" > "$DEST/.stamp"
log "node $(node --version), e2b $(node -p "require('$DEST/node_modules/e2b/package.json').version")"
