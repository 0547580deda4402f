"""Compile every KDA Triton kernel for sm_90 (Hopper) ahead of time, without a GPU, and print resource use.

Run as a script (the interpreter must be off, so not inside a TRITON_INTERPRET=1 process):
    python tests/kda/hopper_compile.py bf16 128
Prints one line per kernel: registers, spill stack bytes, and tensor-core instruction counts from the SASS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3sys.kda.triton.chunks import CHUNK
from k3sys.kda.triton.fused import fused_fwd_kernel
from k3sys.kda.triton.inter import inter_bwd_kernel, inter_fwd_kernel
from k3sys.kda.triton.intra import intra_fwd_kernel
from k3sys.kda.triton.intra_bwd import intra_bwd_kernel
from k3sys.kda.triton.op import GRAD_BV, GRAD_WARPS, _warps

FP32_ARGS = {"g", "gc", "h0", "ht", "dht", "dh0", "dvn", "dg"}
INDEX_ARGS = {"cu_seqlens", "chunk_indices", "chunk_offsets"}


def signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name == "scale":
            return "fp32"
        return "*i32" if name in INDEX_ARGS else "*fp32" if name in FP32_ARGS else f"*{dtype}"

    return {name: kind(name) for name in fn.arg_names}


def aligned_pointers(fn, sig: dict[str, str]) -> dict:
    """The 16-byte alignment hint a JIT launch gives every pointer argument (torch allocations are aligned)."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in sig.items() if kind[0] == "*"}


def compile_all(dtype: str, K: int, V: int) -> list[str]:
    prec = "ieee" if dtype == "fp32" else "tf32"
    BK, BV = max(16, K), min(64 if K <= 128 else 32, V)
    base = dict(H=32, K=K, V=V, C=CHUNK, BK=BK, PREC=prec)
    kernels = [
        (intra_fwd_kernel, dict(base, BV=V), _warps(BK), 3),
        (inter_fwd_kernel, dict(base, BV=BV, USE_H0=True, STORE_O=True, STORE_HT=True, STORE_STATES=True),
         _warps(BK), 2),
        (inter_bwd_kernel, dict(base, BV=BV, USE_DHT=True, STORE_DH0=True), _warps(BK), 2),
        (intra_bwd_kernel, dict(base, BV=min(GRAD_BV, V)), GRAD_WARPS, 3),
        (fused_fwd_kernel, dict(base, BV=BV, USE_H0=True, STORE_HT=True), _warps(BK), 2),
    ]
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    lines = []
    for fn, constexprs, warps, stages in kernels:
        sig = signature(fn, dtype, constexprs)
        src = ASTSource(fn, sig, constexprs=constexprs, attrs=aligned_pointers(fn, sig))
        options = {"num_warps": warps, "num_stages": stages}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            dump = lambda flag: subprocess.run([f"{bin_dir}/cuobjdump", flag, f.name], capture_output=True, text=True)
            usage, sass = dump("-res-usage").stdout, dump("-sass").stdout
        res = dict(item.split(":") for line in usage.splitlines() if "REG:" in line for item in line.split())
        lines.append(f"{fn.__name__} {dtype} K={K} V={V} warps={warps} REG={res.get('REG')} STACK={res.get('STACK')} "
                     f"HGMMA={sass.count('HGMMA')} HMMA={sass.count('HMMA')}")
    return lines


if __name__ == "__main__":
    dtype, K = sys.argv[1], int(sys.argv[2])
    V = int(sys.argv[3]) if len(sys.argv) > 3 else K
    print("\n".join(compile_all(dtype, K, V)))
