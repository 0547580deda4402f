#!/usr/bin/env bash
# k3sys-agent, the PID 1 of every sandbox (agent/*.c): one static binary, no runtime dependencies
# inside any rootfs. Idempotent: rebuilt only when its source or build flags change (the stamp holds
# their hash); a cached run takes a few milliseconds. Installed as $K3SYS_SYSTEM_DIR/bin/k3sys-agent
# (default /opt/k3sys); K3SYS_AGENT_OUT=<path> builds to another path instead (tests, CI).
# K3SYS_AGENT_SANITIZE=1 (with K3SYS_AGENT_OUT) builds it dynamically linked under AddressSanitizer and
# UBSan instead, for the protocol tests (tests/sandbox/runtime/test_agent_sanitized.py); never installed.
#
# C with glibc's static libc (libc6-dev, which gcc already brings; install-sandbox.sh builds its
# hook the same way): nothing to add to the machine, and the agent needs only system calls. It
# avoids the libc functions that would need NSS at run time (it reads /etc/passwd itself).
set -euo pipefail

PREFIX=${K3SYS_SYSTEM_DIR:-/opt/k3sys}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=("$ROOT"/agent/*.c "$ROOT"/agent/*.h)
# -fanalyzer (gcc's static analysis: leaks, NULL from an allocation, use after free) on every build:
# it adds a few seconds (3 s of CPU here) to a build, which happens only when the source changes.
WARN=(-Wall -Wextra -Werror -fanalyzer)
CFLAGS=(-O2 -static "${WARN[@]}" -D_FORTIFY_SOURCE=2)
if [ "${K3SYS_AGENT_SANITIZE:-}" = 1 ]; then
    if [ -z "${K3SYS_AGENT_OUT:-}" ]; then
        echo "[install-agent] K3SYS_AGENT_SANITIZE=1 needs K3SYS_AGENT_OUT (a sanitized agent is never installed)" >&2
        exit 2
    fi
    # no -static: the sanitizers' runtimes are shared libraries; no -fanalyzer (the normal build has it)
    CFLAGS=(-O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-omit-frame-pointer
            -fno-sanitize-recover=undefined)
fi
OUT=${K3SYS_AGENT_OUT:-$PREFIX/bin/k3sys-agent}
STAMP=${K3SYS_AGENT_OUT:+$OUT.stamp}
STAMP=${STAMP:-$PREFIX/stamps/agent}

log() { echo "[install-agent] $*"; }
# shellcheck source=lib/apt.sh
source "$ROOT/scripts/lib/apt.sh"

# Its build needs gcc and the static libc; `make system` runs this script before install-sandbox.sh
# (which needs gcc too), so on a fresh Debian host it installs them itself. g++ as well: KDA's fused
# decode step (src/k3sys/kda/fused_step.cpp) is compiled with it on first use.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt_ensure gcc g++ libc6-dev
fi
if ! command -v gcc >/dev/null || [ ! -e "$(gcc -print-file-name=libc.a)" ]; then
    log "no gcc with a static libc (Debian: gcc libc6-dev): skipping (sandboxes need the agent)"
    exit 0
fi
want=$({ cat "${SRC[@]}"; echo "${CFLAGS[*]}"; gcc --version | head -n1; } | sha256sum | cut -c1-16)
if [ -x "$OUT" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
mkdir -p "$(dirname "$OUT")" "$(dirname "$STAMP")"
# The static glibc warns about getpw*/dlopen when any object references them; we reference none.
gcc "${CFLAGS[@]}" -o "$OUT.new" "$ROOT"/agent/*.c
mv -f "$OUT.new" "$OUT"
echo "$want" > "$STAMP"
log "built $OUT ($(stat -c %s "$OUT") bytes)"
