"""Build-on-first-use C++ kernels for the CPU (`fused_step.cpp`, `chunk_fwd.cpp`): g++, cached, ctypes.

The kernels take raw pointers only, so each builds in about a second without torch's headers or ninja
(`torch.utils.cpp_extension` would need both), and a call through ctypes costs a few microseconds.
Libraries are cached under `$K3SYS_CACHE_DIR` (default `~/.cache/k3sys`), keyed by the source, the
compiler, the flags and this CPU's flags (they are built with `-march=native`). No compiler, a failed
build or `K3SYS_KDA_FUSED=0` give None (with one warning for the first two), and the caller runs torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC")


def cache_dir() -> Path:
    """Where built libraries are kept: `$K3SYS_CACHE_DIR`, else `$XDG_CACHE_HOME/k3sys` or `~/.cache/k3sys`."""
    if os.environ.get("K3SYS_CACHE_DIR"):
        return Path(os.environ["K3SYS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3sys"


def _cpu_flags() -> str:
    """This CPU's feature flags (the build is -march=native: a cache shared by other CPUs must not match)."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def load_library(source: Path, what: str, fallback: str,
                 signatures: dict[str, tuple[list, type]]) -> ctypes.CDLL | None:
    """Build `source` (once per source, compiler and CPU) and load it, or None with one warning.

    what: the kernel's name in warnings ("the fused KDA step"); fallback: what runs instead.
    signatures: exported function name -> (argtypes, restype), set on the loaded library.
    """
    if os.environ.get("K3SYS_KDA_FUSED", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        warnings.warn(f"no C++ compiler (g++ or $CXX): {fallback}", stacklevel=4)
        return None
    key = hashlib.sha256("\0".join((source.read_text(), compiler, *FLAGS, _cpu_flags())).encode()).hexdigest()[:16]
    path = cache_dir() / f"kda_{source.stem}-{key}.so"
    # concurrent builders (processes, threads) each write their own file and rename it whole
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(source)], check=True, capture_output=True,
                           text=True, timeout=300)
            os.replace(tmp, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        tmp.unlink(missing_ok=True)
        detail = getattr(e, "stderr", None) or e
        warnings.warn(f"building {what} failed, {fallback}: {detail}", stacklevel=4)
        return None
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
