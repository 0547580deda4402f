"""KDA's Triton kernels against the fp64 naive recurrence and the PyTorch chunked op.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before triton is
first imported); with CUDA the same tests run on the GPU unchanged.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("K3SYS_TRITON_AUTOTUNE", "0")  # on a GPU, tuning every test shape would take minutes
pytest.importorskip("triton", reason="triton is not installed, so the Triton backend cannot run")

from kda_inputs import OPTION_SETS, make_raw_inputs, option_grads, rel_rms  # noqa: E402
from kda_inputs import make_inputs as make_qkvgb  # noqa: E402

from k3sys.kda import kda_chunk, kda_naive  # noqa: E402
from k3sys.kda.triton import kda_triton, kda_triton_fused  # noqa: E402
from k3sys.kda.triton.chunks import chunk_maps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative RMS against fp64: bf16 and fp32 from the issue; fp16 has 3 more mantissa bits than bf16
TOL = {torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 1e-5}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")

pytestmark = pytest.mark.timeout(300)


def make_inputs(B, T, H, K, V, N, dtype, seed=0):
    """q, k, v, beta in dtype, g (safe gate, >= -5) and the initial state `[N, H, K, V]` in fp32; leaves on DEVICE."""
    q, k, v, g, beta = make_qkvgb(B, T, H, K, V, gate="safe", seed=seed)
    h0 = torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(seed + 1))
    xs = [q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.to(dtype), h0]
    return [x.to(DEVICE).requires_grad_() for x in xs]


def run(op, inputs, cu_seqlens, with_state: bool, grads_seed: int = 1):
    """Forward, then backward of a random projection of o (and of the final state): (o, state, grads)."""
    q, k, v, g, beta, h0 = inputs
    o, ht = op(q, k, v, g, beta, initial_state=h0 if with_state else None, output_final_state=with_state,
               cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(grads_seed)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    if with_state:
        loss = loss + (ht.double() * torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
    used = inputs if with_state else inputs[:5]
    return o, ht, torch.autograd.grad(loss, used)


def fp64(inputs):
    return [x.detach().double().requires_grad_() for x in inputs]


def check(got, ref, tol, what):
    o, ht, grads = got
    o_ref, ht_ref, grads_ref = ref
    errors = {"o": rel_rms(o, o_ref)}
    if ht is not None:
        errors["final_state"] = rel_rms(ht, ht_ref)
    errors |= {f"d{name}": rel_rms(a, b) for name, a, b in zip(NAMES, grads, grads_ref, strict=False)}
    assert all(torch.isfinite(x).all() for x in (o, *grads)), f"non-finite values vs {what}"
    bad = {name: f"{err:.2e}" for name, err in errors.items() if not err <= tol}
    assert not bad, f"relative RMS above {tol:.0e} vs {what}: {bad}"


CASES = [
    pytest.param(2, 50, 2, 64, 64, torch.float32, True, id="B2-T50-H2-K64-V64-fp32"),
    pytest.param(1, 64, 2, 128, 128, torch.bfloat16, True, id="B1-T64-H2-K128-V128-bf16"),
    pytest.param(1, 45, 2, 64, 128, torch.bfloat16, False, id="B1-T45-H2-K64-V128-bf16-nostate"),
    pytest.param(1, 37, 1, 128, 64, torch.float16, True, id="B1-T37-H1-K128-V64-fp16"),
    pytest.param(1, 24, 1, 256, 256, torch.float32, True, id="B1-T24-H1-K256-V256-fp32"),
    pytest.param(1, 20, 1, 256, 64, torch.bfloat16, True, id="B1-T20-H1-K256-V64-bf16"),
    pytest.param(1, 300, 1, 64, 64, torch.bfloat16, True, id="B1-T300-H1-K64-V64-bf16"),
]


@pytest.mark.parametrize("B,T,H,K,V,dtype,with_state", CASES)
def test_matches_naive(B, T, H, K, V, dtype, with_state):
    inputs = make_inputs(B, T, H, K, V, B, dtype)
    got = run(kda_triton, inputs, None, with_state)
    check(got, run(kda_naive, fp64(inputs), None, with_state), TOL[dtype], "fp64 kda_naive")
    torch_chunk = lambda *a, **kw: kda_chunk(*a, **kw, backend="torch")
    check(got, run(torch_chunk, fp64(inputs), None, with_state), TOL[dtype], "fp64 kda_chunk (torch)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_matches_naive(dtype):
    cu_seqlens = torch.tensor([0, 1, 10, 41, 77], device=DEVICE)  # lengths 1, 9, 31, 36
    inputs = make_inputs(1, 77, 2, 64, 64, 4, dtype, seed=2)
    got = run(lambda *a, **kw: kda_chunk(*a, **kw, backend="triton"), inputs, cu_seqlens, True)
    check(got, run(kda_naive, fp64(inputs), cu_seqlens, True), TOL[dtype], "fp64 kda_naive, varlen")


def test_fused_matches_two_phase():
    cu_seqlens = torch.tensor([0, 23, 64], device=DEVICE)
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(1, 64, 2, 64, 128, 2, torch.bfloat16, seed=3))
    o, ht = kda_triton_fused(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o_ref, ht_ref = kda_naive(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(),
                              output_final_state=True, cu_seqlens=cu_seqlens)
    assert rel_rms(o, o_ref) < TOL[torch.bfloat16] and rel_rms(ht, ht_ref) < TOL[torch.bfloat16]


def test_chunk_maps_cover_every_token_once():
    cu = torch.tensor([0, 1, 16, 17, 50, 64])
    maps = chunk_maps(1, 64, cu, torch.device("cpu"))
    lengths = cu[1:] - cu[:-1]
    assert maps.offsets.tolist() == [0, 1, 2, 3, 6, 7]  # lengths 1, 15, 1, 33, 14
    assert maps.num_chunks == 7 and maps.indices.shape == (7, 2)
    seq, local = maps.indices.long().unbind(1)
    starts = cu[seq] + 16 * local
    ends = torch.minimum(starts + 16, cu[seq + 1])
    covered = torch.zeros(64, dtype=torch.long)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        covered[s:e] += 1
    assert covered.eq(1).all() and (ends - starts).sum() == lengths.sum()
    fixed = chunk_maps(3, 40, None, torch.device("cpu"))
    assert fixed.num_chunks == 9 and fixed.cu_seqlens.tolist() == [0, 40, 80, 120]


def test_backend_dispatch():
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(1, 20, 1, 64, 64, 1, torch.float32))
    args = (q, k, v, g, beta)
    o_triton, _ = kda_triton(*args)
    o_torch, _ = kda_chunk(*args, backend="torch")
    assert torch.equal(kda_chunk(*args, backend="triton")[0], o_triton)
    assert torch.equal(kda_chunk(*args)[0], o_triton if DEVICE == "cuda" else o_torch)  # "auto"
    assert rel_rms(o_triton, o_torch) < TOL[torch.float32]
    with pytest.raises(ValueError, match="backend must be one of"):
        kda_chunk(*args, backend="cuda")
    with pytest.raises(ValueError, match="chunk_size=32"):
        kda_chunk(*args, chunk_size=32, backend="triton")
    # outside the safe gate: "triton" refuses, "auto" runs the torch path
    steep = g * 3.0
    with pytest.raises(ValueError, match="safe gate"):
        kda_chunk(q, k, v, steep, beta, backend="triton")
    assert torch.equal(kda_chunk(q, k, v, steep, beta)[0], kda_chunk(q, k, v, steep, beta, backend="torch")[0])


def test_rejects_unsupported_inputs():
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 16, 1, 64, 64, 1, torch.float32))
    with pytest.raises(ValueError, match="float64"):
        kda_triton(q.double(), k, v.double(), g, beta)
    # an fp64 state asks for fp64 compute (kda_chunk's contract): "triton" refuses, "auto" runs torch
    S0 = torch.randn(1, 1, 64, 64, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="initial_state of torch.float64"):
        kda_chunk(q, k, v, g, beta, initial_state=S0, backend="triton")
    _, S = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True, backend="auto")
    assert S.dtype == torch.float64
    big = torch.zeros(1, 16, 1, 320, device=DEVICE)
    with pytest.raises(ValueError, match="K=320"):
        kda_triton(big, big, v, big, beta)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU refusal outside the interpreter")
def test_cpu_without_interpreter_is_refused():
    code = ("import torch; from k3sys.kda import kda_chunk; x = torch.zeros(1, 16, 1, 16)\n"
            "try:\n    kda_chunk(x, x, x, x, torch.zeros(1, 16, 1), backend='triton')\n"
            "except ValueError as e:\n    print(e)")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "needs CUDA tensors" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


@pytest.mark.timeout(600)
def test_kernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia", reason="this triton build has no NVIDIA backend")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("hopper_compile.py")), "bf16", "128"],
                         env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 5
    # bf16 tiles must reach the tensor cores (wgmma on Hopper, or mma.sync for the 16-row products)
    assert all(int(line.split("HMMA=")[1]) + int(line.split("HGMMA=")[1].split()[0]) > 0 for line in lines), lines


def test_tuning_space_becomes_autotune_configs(monkeypatch):
    from k3sys.kda.triton.intra import intra_fwd_kernel
    from k3sys.kda.triton.tuning import TunedKernel

    monkeypatch.setenv("K3SYS_TRITON_AUTOTUNE", "1")
    tuned = TunedKernel(intra_fwd_kernel, interpreted=False, BV=(16, 32), num_warps=(4, 8), num_stages=(2,))
    points = {(c.kwargs["BV"], c.num_warps, c.num_stages) for c in tuned.tuned.configs}
    assert points == {(16, 4, 2), (16, 8, 2), (32, 4, 2), (32, 8, 2)}
    assert TunedKernel(intra_fwd_kernel, interpreted=True, num_warps=(4, 8)).tuned is None
    with pytest.raises(ValueError, match="defaults must give"):
        TunedKernel(intra_fwd_kernel, interpreted=True, num_warps=(4, 8))[(1,)](defaults={})


def _triton_chunk(*args, **kwargs):
    return kda_chunk(*args, **kwargs, backend="triton")


def _to_device(xs, opts, S0, dtype):
    xs = [x.to(DEVICE, dtype if i < 3 else torch.float32) if i != 4 else x.to(DEVICE, dtype) for i, x in enumerate(xs)]
    return xs, {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in opts.items()}, S0.to(DEVICE)


def _fp64(xs, opts, S0):
    return ([x.detach().double() for x in xs], {n: (x.double() if isinstance(x, torch.Tensor) else x)
                                                for n, x in opts.items()}, S0.double())


@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_options_match_naive_gva_varlen(option_set):
    """Every fla option through the Triton backend, GVA (HV = 2 H) and a varlen batch with an empty sequence."""
    xs, opts = make_raw_inputs(1, 40, 1, 2, 32, 32, option_set, seed=4)
    cu = torch.tensor([0, 17, 17, 40], device=DEVICE)
    S0 = torch.randn(3, 2, 32, 32, generator=torch.Generator().manual_seed(5))
    xs, opts, S0 = _to_device(xs, opts, S0, torch.float32)
    o, S, got = option_grads(_triton_chunk, xs, opts, S0, cu)
    o_ref, S_ref, ref = option_grads(kda_naive, *_fp64(xs, opts, S0), cu)
    errors = {"o": rel_rms(o, o_ref), "S": rel_rms(S, S_ref)} | {n: rel_rms(got[n], ref[n]) for n in ref}
    assert all(err <= TOL[torch.float32] for err in errors.values()), errors


def test_bf16_with_in_kernel_activations_holds_the_state_to_1e6():
    xs, opts = make_raw_inputs(1, 64, 1, 1, 32, 32, "all_v_first", seed=6)
    xs, opts, S0 = _to_device(xs, opts, torch.randn(1, 1, 32, 32), torch.bfloat16)
    _, S = _triton_chunk(*xs, initial_state=S0, output_final_state=True, **opts)
    xs64, opts64, S064 = _fp64(xs, opts, S0)
    _, S_ref = kda_naive(*xs64, initial_state=S064, output_final_state=True, **opts64)
    assert rel_rms(S, S_ref) <= 1e-6


@pytest.mark.parametrize("v_first", [False, True])
def test_intermediate_states_and_no_tokens(v_first):
    cu = torch.tensor([0, 20, 20, 37], device=DEVICE)
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(1, 37, 1, 32, 32, 3, torch.float32, seed=7))
    h0 = h0.mT if v_first else h0
    _, S, h = _triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            return_intermediate_states=True, state_v_first=v_first)
    _, S_ref, h_ref = kda_naive(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(),
                                output_final_state=True, cu_seqlens=cu, return_intermediate_states=True,
                                state_v_first=v_first)
    assert h.shape == h_ref.shape == (1, 4, 1, 32, 32)  # 2 + 0 + 2 chunks of 16
    assert rel_rms(h, h_ref) <= TOL[torch.float32] and rel_rms(S, S_ref) <= TOL[torch.float32]
    o, S = _triton_chunk(*(x[:, :0] for x in (q, k, v, g, beta)), initial_state=h0[:1], output_final_state=True)
    assert o.shape == (1, 0, 1, 32) and torch.equal(S, h0[:1])


def test_triton_refuses_what_it_cannot_run():
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 16, 1, 32, 32, 1, torch.float32))
    reset = g.clone()
    reset[0, 3] = -torch.inf
    with pytest.raises(ValueError, match="safe gate"):
        _triton_chunk(q, k, v, reset, beta)
    wide = torch.zeros(1, 16, 1, 512, device=DEVICE)
    with pytest.raises(ValueError, match="K=512"):
        _triton_chunk(wide, wide, v, wide, beta)
