"""KDA on one GPU: our two-phase Triton kernels vs fla's chunk_kda, causal SDPA, and our one-kernel variant.

bf16, B=1, K=V=128, T in {4096, 8192, 32768}, H in {96, 32}; forward and forward+backward, median ms of
triton.testing.do_bench (CUDA events), TFLOP/s and ratios. GPU only: on a machine without CUDA it says so
and exits 0 without writing results.

    python bench/kda_gpu.py [--out DIR] [--quick]

FLOPs are nominal, the same count for every KDA implementation (ours at C = 16): per token and head
phase 1 costs 2C(3K + V) + 12C^2 and phase 2 6KV + 2CV; SDPA's causal forward 2 T^2 D per head.
Forward+backward counts 3x the forward for KDA and 3.5x for SDPA (FlashAttention's convention).
fla runs with `safe_gate=True` (its fast path for gates bounded at -5, which ours are).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# H=96 first, T=8192 leading: FlashKDA's published comparison point (2.62 ms vs fla's 4.84 ms on an H20),
# so a run cut short by the device's time limit still has it. fla autotunes once per H.
CASES = ((8192, 96), (4096, 96), (32768, 96), (4096, 32), (8192, 32), (32768, 32))
D = 128
C = 16
METHODS = ("ours", "fla", "sdpa", "ours_fused")


def kda_flops(T: int, H: int, K: int = D, V: int = D) -> float:
    return float(T * H * (2 * C * (3 * K + V) + 12 * C * C + 6 * K * V + 2 * C * V))


def sdpa_flops(T: int, H: int) -> float:
    return float(2 * T * T * D * H)


def make_inputs(T: int, H: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = F.normalize(randn(1, T, H, D), dim=-1).bfloat16()
    k = F.normalize(randn(1, T, H, D), dim=-1).bfloat16()
    v = randn(1, T, H, D).bfloat16()
    g = -5.0 * torch.sigmoid(randn(1, T, H, D))  # the safe gate's range, fp32
    beta = torch.rand(1, T, H, device="cuda", generator=gen).bfloat16()
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def kda_methods() -> dict[str, Callable | None]:
    from k3sys.kda.triton import kda_triton, kda_triton_fused

    try:
        from fla.ops.kda import chunk_kda

        fla = lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta, safe_gate=True)
    except ImportError:
        fla = None
    return {"ours": kda_triton, "fla": fla, "ours_fused": kda_triton_fused}


def bench_ms(fn: Callable[[], object], grads: list[torch.Tensor] | None = None) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=200, grad_to_none=grads, return_mode="median"))


def bench_kda(T: int, H: int, methods: dict[str, Callable | None], row: dict) -> None:
    """Median ms of each KDA method (fwd, fwd+bwd) into row, and ours-vs-fla output agreement."""
    x = make_inputs(T, H)
    do = torch.randn_like(x["v"])
    outs = {}
    for name, op in methods.items():
        row["fwd_ms"][name] = row["fwd_bwd_ms"][name] = None
        if op is None:
            continue
        try:  # one failing implementation must not cost the others' numbers on a one-shot GPU run
            with torch.no_grad():
                outs[name] = op(**x)[0]
                row["fwd_ms"][name] = bench_ms(lambda op=op: op(**x))
            if name == "ours_fused":  # forward-only baseline
                continue
            leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
            row["fwd_bwd_ms"][name] = bench_ms(lambda op=op, leaves=leaves: op(**leaves)[0].backward(do),
                                               grads=list(leaves.values()))
        except Exception as e:  # noqa: BLE001
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"{name} failed at T={T} H={H}: {row['errors'][name]}", flush=True)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    if "fla" in outs and "ours" in outs:
        row["rel_rms_ours_vs_fla"] = rel(outs["ours"], outs["fla"])
    if "ours_fused" in outs and "ours" in outs:
        row["rel_rms_fused_vs_ours"] = rel(outs["ours_fused"], outs["ours"])


def bench_sdpa(T: int, H: int, row: dict) -> None:
    """Causal softmax attention with the same heads, in FlashAttention's layout `[B, H, T, D]`."""
    q, k, v = (torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        row["fwd_ms"]["sdpa"] = bench_ms(sdpa)
    row["fwd_bwd_ms"]["sdpa"] = bench_ms(lambda: sdpa().backward(do), grads=[q, k, v])


def run_case(T: int, H: int, methods: dict[str, Callable | None]) -> dict:
    row: dict = {"T": T, "H": H, "fwd_ms": {}, "fwd_bwd_ms": {}}
    bench_kda(T, H, methods, row)
    torch.cuda.empty_cache()
    bench_sdpa(T, H, row)
    torch.cuda.empty_cache()
    for mode, factor_kda, factor_sdpa in (("fwd", 1.0, 1.0), ("fwd_bwd", 3.0, 3.5)):
        ms = row[f"{mode}_ms"]
        flops = {n: (sdpa_flops(T, H) * factor_sdpa if n == "sdpa" else kda_flops(T, H) * factor_kda) for n in ms}
        row[f"{mode}_tflops"] = {n: (flops[n] / (t * 1e-3) / 1e12 if t else None) for n, t in ms.items()}
        ours = ms["ours"]
        row[f"{mode}_ratio_to_ours"] = {n: (t / ours if t and ours else None) for n, t in ms.items() if n != "ours"}
    return row


def fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f}"


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
    for mode, title in (("fwd", "forward"), ("fwd_bwd", "forward + backward")):
        table = Table(title=f"KDA bf16 {title}, B=1, K=V=128: median ms (TFLOP/s); ratio = other ms / ours ms")
        for col in ("T", "H", *METHODS, "fla/ours", "sdpa/ours", "fused/ours"):
            table.add_column(col, justify="right")
        for r in rows:
            ms, tf, sp = r[f"{mode}_ms"], r[f"{mode}_tflops"], r[f"{mode}_ratio_to_ours"]
            cells = [f"{fmt(ms[m], '.3f')} ({fmt(tf[m], '.0f')})" if ms[m] else "n/a" for m in METHODS]
            ratios = [fmt(sp[m], ".2f") for m in ("fla", "sdpa", "ours_fused")]
            table.add_row(str(r["T"]), str(r["H"]), *cells, *ratios)
        Console(width=160).print(table)


def versions() -> dict[str, str]:
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name(), "fla": "n/a"}
    try:
        from importlib.metadata import version

        out["fla"] = version("fla-core")
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        pass
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for kda_gpu.json")
    parser.add_argument("--quick", action="store_true", help="only T=4096, H=32 (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kda_gpu.py needs a CUDA GPU; none here, so nothing was measured or written.")
        return 0
    methods = kda_methods()
    cases = [(4096, 32)] if args.quick else CASES
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "kda_gpu.json"
    rows = []
    for T, H in cases:
        t0 = time.time()
        rows.append(run_case(T, H, methods))
        summary = " ".join(f"{m}={fmt_ms(rows[-1]['fwd_ms'][m])}/{fmt_ms(rows[-1]['fwd_bwd_ms'][m])}" for m in METHODS)
        print(f"T={T} H={H} fwd/fwd+bwd ms: {summary} ({time.time() - t0:.0f}s wall, the first case of each H "
              "includes compiling and fla's autotuning)", flush=True)
        # rewritten after every case, so a run cut short still leaves what it measured
        path.write_text(json.dumps({"versions": versions(), "D": D, "chunk": C, "rows": rows}, indent=2))
    print_table(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
