#!/usr/bin/env bash
# System pieces for sandboxes with `network=True` (idempotent; a cached re-run takes well under a second):
#   - nftables (`nft`): the NAT, the egress policy and the isolation rules of every sandbox's
#     network namespace (src/k3sys/sandbox/runtime/drivers/network.py, docs/sandbox-network.md);
#   - iproute2 (`ip`): network namespaces and veth pairs.
# Nothing is configured here: the driver creates its nftables table and enables IPv4 forwarding
# (net.ipv4.ip_forward=1) when the first sandbox with a network is created.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "[install-network] $*"; }
# shellcheck source=lib/apt.sh
source "$ROOT/scripts/lib/apt.sh"

# Sandboxes need root; without it (or apt) their tests skip with that reason.
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "skipping: needs root on a Debian-like Linux (elsewhere install nftables and iproute2 by hand)"
    exit 0
fi
apt_ensure nftables iproute2
log "nft $(nft --version | awk '{print $2}'), $(ip -V)"
