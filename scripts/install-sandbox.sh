#!/usr/bin/env bash
# System pieces for k3sys.sandbox (idempotent; a cached re-run takes well under a second):
#   - Debian packages: runc, busybox-static, debootstrap, e2fsprogs (mkfs.ext4: each sandbox's disk), skopeo and
#     zstd (`k3sys sandbox template import`: registry pulls, zstd layers), and CRIU's build dependencies;
#   - CRIU 4.1.x built from Debian trixie's source (bookworm's 3.17 fails on recent kernels' vDSO),
#     with our patches (scripts/sandbox/patches: tolerate Linux >= 6.16's SO_PASSCRED refusal on inet
#     sockets; skip the conntrack walk for empty network namespaces; read another user's rlimits
#     from /proc when the host withholds CAP_SYS_RESOURCE; open /dev/userfaultfd so that lazy
#     restores work in user namespaces; start a lazy restore's background transfer only once the
#     tasks run; check a dump's namespaces through descriptors opened with CRIU's own credentials,
#     so a non-dumpable task, the agent, restored by CRIU can be dumped again), installed into
#     $K3SYS_SYSTEM_DIR/bin/criu, plus the configuration the driver hands it (etc/criu.conf);
#   - bin/k3sys-net-up, the prestart hook that sets up a sandbox's network namespace (loopback; with
#     network=True its veth end, moved in) at every create and restore (was bin/k3sys-lo-up),
#     bin/k3sys-criu-gate, the CRIU of a `runc restore` started before the sandbox is ready, and
#     bin/k3sys-inotify-limit, which sets the inotify limits inside a sandbox's user namespace;
#   - the cgroup2 mount option favordynmods (no RCU grace period on each move into a cgroup);
#   - the host's inotify limits raised to the sandboxes' budget (runtime/drivers/inotify.py);
#   - the templates `busybox` and `base` (E2B's default: `debian` plus the user `user`).
# Everything lands under K3SYS_SYSTEM_DIR (default /opt/k3sys); the system's apt sources are untouched
# (trixie's source index goes to a private apt state directory).
set -euo pipefail

PREFIX=${K3SYS_SYSTEM_DIR:-/opt/k3sys}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCHES=("$ROOT"/scripts/sandbox/patches/criu-4.1-*.patch)
CRIU_SERIES=4.1
# CRIU caches what it learns about the kernel (20 ms per run here) only in a tmpfs directory, and
# /run is not tmpfs on every host; /dev/shm is. The runtime re-creates it (root, 0700) after a reboot.
KDAT_DIR=/dev/shm/k3sys-criu

log() { echo "[install-sandbox] $*"; }
# shellcheck source=lib/apt.sh
source "$ROOT/scripts/lib/apt.sh"

if [ "$(id -u)" != 0 ]; then
    log "not root: skipping (sandboxes need root; their tests skip with that reason)"
    exit 0
fi
if [ "$(uname -s)" != Linux ] || ! command -v apt-get >/dev/null; then
    log "not a Debian-like Linux: skipping (install runc, busybox-static and CRIU >= $CRIU_SERIES by hand)"
    exit 0
fi

# --- Debian packages ---------------------------------------------------------------------------
# skopeo: `k3sys sandbox template import docker://...` pulls registry images with it; zstd: zstd layers.
PKGS=(runc busybox-static debootstrap e2fsprogs skopeo zstd
      gcc make pkg-config libbsd-dev libcap-dev libnet1-dev libnl-3-dev
      libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler uuid-dev)
apt_ensure "${PKGS[@]}"

# --- CRIU --------------------------------------------------------------------------------------
# The stamp holds what the binary was built from; a changed patch or build setting rebuilds it.
want=$({ cat "${PATCHES[@]}"; echo "series=$CRIU_SERIES rundir=$KDAT_DIR no_gnutls"; } | sha256sum | cut -c1-16)
stamp="$PREFIX/stamps/criu"
if [ ! -x "$PREFIX/bin/criu" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    build="$PREFIX/build"
    apt_dir="$build/apt"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$PREFIX/bin" "$PREFIX/stamps"
    # Reuse the Debian mirror the machine already uses; deb-src for trixie in a private source list.
    mirror=$(grep -hoE '(https?://[^ ]+/debian)/?( |$)' /etc/apt/sources.list.d/*.sources \
             /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null | head -n1 | tr -d ' ' || true)
    mirror=${mirror%/}
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
        > "$apt_dir/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null -o APT::Sandbox::User=root
              -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
    log "fetching CRIU source index (trixie) from $mirror"
    apt-get "${apt_opts[@]}" update -q >/dev/null
    src=$(apt-cache "${apt_opts[@]}" showsrc criu)
    dir=$(awk '/^Directory:/ {print $2; exit}' <<<"$src")
    # Only the upstream tarball: we build with make and apply our own patch, not Debian's packaging.
    # Its SHA-256 comes from the signed Sources index, so apt-helper verifies what it downloads.
    read -r sha orig < <(awk '/^Checksums-Sha256:/ {f=1; next} /^[^ ]/ {f=0} f && $3 ~ /\.orig\.tar/ {print $1, $3; exit}' <<<"$src")
    version=${orig#criu_}; version=${version%.orig.tar*}
    case "$version" in
        "$CRIU_SERIES".*|"$CRIU_SERIES") ;;
        *) log "trixie has CRIU $version, this script expects $CRIU_SERIES.x: update it and the patch"; exit 1 ;;
    esac
    log "downloading $orig"
    /usr/lib/apt/apt-helper "${apt_opts[@]}" download-file "$mirror/$dir/$orig" "$build/$orig" "SHA256:$sha" >/dev/null
    rm -rf "$build/criu-$version"
    tar -xf "$build/$orig" -C "$build"
    log "building CRIU $version (make -j$(nproc) criu)"
    for p in "${PATCHES[@]}"; do
        patch -d "$build/criu-$version" -p1 --forward --quiet < "$p"
    done
    # NO_GNUTLS: TLS is only for remote page servers; without it CRIU loads 9 shared libraries
    # fewer, ~1 ms off each of the two CRIU starts per checkpoint or restore.
    make -C "$build/criu-$version" -j"$(nproc)" RUNDIR="$KDAT_DIR" NO_GNUTLS=1 criu >"$build/criu-build.log" 2>&1 \
        || { tail -n 30 "$build/criu-build.log"; exit 1; }
    install -m 0755 "$build/criu-$version/criu/criu" "$PREFIX/bin/criu.new"
    mv -f "$PREFIX/bin/criu.new" "$PREFIX/bin/criu"
    rm -rf "$build/criu-$version"
    echo "$want" > "$stamp"
    log "installed $("$PREFIX/bin/criu" --version | head -n1) into $PREFIX/bin/criu"
fi

# runc starts CRIU as `criu swrk` and cannot pass it most options. CRIU reads etc/criu.conf (named by
# CRIU_CONFIG_FILE, which the driver sets) before runc's settings, and etc/criu-override.conf (named
# by each container's `org.criu.config` annotation) after them, replacing them. No network lock: it
# needs iptables (absent here), and a sandbox's namespace holds loopback only, whose traffic stops
# with the frozen sandbox (CRIU 4.1 crashes on this option in the annotation's file, so it stays in
# the first). No cgroup management by CRIU: runc creates the cgroups, sets their limits and restores
# into them itself, so CRIU's dump and restore of cgroup properties (it mounts all 11 v1
# hierarchies: ~9 ms of every dump, with the sandbox frozen) only repeat runc's work. Log level 3
# (errors, warnings and one line per step) instead of runc's 4: CRIU writes its log a line per
# system call, and the ~2,000 debug lines of a restore cost it ~10 of its ~40 ms here.
mkdir -p "$PREFIX/etc"
put_conf() {  # put_conf FILE CONTENT: (re)write FILE atomically when its content differs
    if [ "$(cat "$1" 2>/dev/null)" != "$2" ]; then
        printf '%s\n' "$2" > "$1.new" && mv -f "$1.new" "$1"
    fi
}
put_conf "$PREFIX/etc/criu.conf" "network-lock skip"
put_conf "$PREFIX/etc/criu-override.conf" "manage-cgroups=ignore
verbosity=3"

# --- small static helpers: the prestart hook, the CRIU gate of early restores, the inotify limits ----
build_static() {  # build_static NAME: scripts/sandbox/NAME.c -> $PREFIX/bin/NAME when its source changed
    local src="$ROOT/scripts/sandbox/$1.c" want
    want=$(sha256sum < "$src" | cut -c1-16)
    mkdir -p "$PREFIX/bin" "$PREFIX/stamps"
    if [ ! -x "$PREFIX/bin/$1" ] || [ "$(cat "$PREFIX/stamps/$1" 2>/dev/null)" != "$want" ]; then
        gcc -O2 -static -Wall -o "$PREFIX/bin/$1.new" "$src"
        mv -f "$PREFIX/bin/$1.new" "$PREFIX/bin/$1"
        echo "$want" > "$PREFIX/stamps/$1"
        log "built $PREFIX/bin/$1"
    fi
}
build_static k3sys-net-up
build_static k3sys-criu-gate
build_static k3sys-inotify-limit

install -d -m 0700 -o root -g root "$KDAT_DIR"

# --- cgroup migrations without an RCU grace period ----------------------------------------------
# Every `runc run`, `restore` and `exec` moves a process into the sandbox's cgroups. Linux makes the
# first move of a burst wait for an RCU grace period (cgroup_threadgroup_rwsem): 8-12 ms of every
# resume here. The cgroup2 mount option `favordynmods` (Linux >= 6.0) removes that wait, at the cost
# of slightly dearer forks and exits (the kernel's trade, documented in cgroup-v2.rst). It applies to
# the whole host and lasts until a reboot (rerun this script then); Linux >= 6.18 keeps it on once set.
cg2=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/self/mounts)
if [ -n "$cg2" ] && ! awk -v m="$cg2" '$2 == m && $4 ~ /favordynmods/ { f = 1 } END { exit !f }' /proc/self/mounts; then
    if mount -o remount,favordynmods "$cg2" 2>/dev/null; then
        log "cgroup2 at $cg2 remounted with favordynmods"
    else
        log "cgroup2 at $cg2: favordynmods not supported by this kernel (resumes keep a ~10 ms grace-period wait)"
    fi
fi

# --- inotify: the host's budget -----------------------------------------------------------------
# runc and CRIU make every sandbox's user namespace as host root, so the kernel charges each inotify
# instance and watch made inside any sandbox to host root too, beside the host's own root processes
# (the limits below; runtime/drivers/inotify.py). The driver gives each sandbox's namespace its own
# limit per user inside (128 instances, 65536 watches); the host's covers every sandbox a host can
# hold (idmap.MAX_RANGES = 4096) at that limit for two users (root and `user`), plus 8192 instances
# and 1048576 watches for the host's own processes. Only ever raised (a higher setting is kept); the
# kernel memory behind them is charged to each sandbox's memory cgroup. Like favordynmods, it lasts
# until a reboot (rerun this script then; the runtime logs a warning while it is short).
INOTIFY_INSTANCES=1056768  # 4096 x 2 x 128 + 8192
INOTIFY_WATCHES=537919488  # 4096 x 2 x 65536 + 1048576
for limit in "max_user_instances $INOTIFY_INSTANCES" "max_user_watches $INOTIFY_WATCHES"; do
    read -r name want <<<"$limit"
    have=$(cat "/proc/sys/fs/inotify/$name")
    if [ "$have" -lt "$want" ]; then
        if { echo "$want" > "/proc/sys/fs/inotify/$name"; } 2>/dev/null; then
            log "fs.inotify.$name raised to $want"
        else
            log "fs.inotify.$name: cannot raise $have to $want here (read-only /proc/sys?): sandboxes share it with host root"
        fi
    fi
done

# --- templates ---------------------------------------------------------------------------------
# The runtime builds templates on first use; prebuild the small default one and E2B's `base` (`debian`
# plus pip, venv, Node.js, npm, curl, wget, procps, build-essential and the user `user`: the first time,
# debootstrap and apt take minutes and need the Debian mirror) when the project's Python is at hand
# (the Makefile creates it before running this script; K3SYS_PYTHON names another). `main` also
# rebuilds a template whose recipe changed (base's package list: template.json's `recipe` stamp), so
# a re-run after such a change rebuilds it once; otherwise it returns at once. `code-interpreter-v1`
# (`base` plus Jupyter, numpy, pandas, matplotlib and the code-interpreter server): its wheels are
# downloaded once from the package index into $PREFIX/cache; its stamp covers the pins, the server's
# files and base's stamp.
py=${K3SYS_PYTHON:-$ROOT/.venv/bin/python}
if [ -x "$py" ]; then
    K3SYS_SYSTEM_DIR="$PREFIX" PYTHONPATH="$ROOT/src" "$py" -c \
        "from k3sys.sandbox.runtime.templates import main; main(['busybox', 'base', 'code-interpreter-v1'])" \
        | sed 's/^/[install-sandbox] /'
fi
exit 0
