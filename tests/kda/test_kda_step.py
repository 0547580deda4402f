import functools

import pytest
import torch
from kda_inputs import OPTION_SETS, make_inputs, make_raw_inputs, rel_rms

from k3sys.kda import fused_step, kda_chunk, kda_naive, kda_step
from k3sys.kda.step import step_unchecked


@pytest.fixture(params=["fused", "torch"])
def path(request, monkeypatch):
    """Run a test on the fused CPU kernel and on the torch formula (its fallback)."""
    if request.param == "fused" and not fused_step.available():
        pytest.skip("the fused kernel could not be built here (no g++?)")
    if request.param == "torch":
        monkeypatch.setattr(fused_step, "available", lambda: False)
    return request.param


def decode(q, k, v, g, beta, state):
    """Token-by-token kda_step over [B, T, ...] inputs -> (o [B, T, H, V], final state)."""
    outs = []
    for t in range(q.shape[1]):
        o, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("gate", ["safe", "huge"])
def test_step_by_step_decode_equals_chunk_fp64(gate):
    q, k, v, g, beta = make_inputs(3, 40, 2, 16, 8, gate=gate)
    S0 = torch.randn(3, 2, 16, 8, dtype=torch.float64)
    o_ref, S_ref = kda_chunk(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o, S = decode(q, k, v, g, beta, S0)
    assert rel_rms(o, o_ref) <= 1e-10
    assert rel_rms(S, S_ref) <= 1e-10


def test_step_fp32_and_bf16_accumulate_in_fp32():
    q, k, v, g, beta = make_inputs(2, 30, 2, 32, 16)
    S0 = torch.randn(2, 2, 32, 16, dtype=torch.float64)
    o_ref, S_ref = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-3)):
        xs = [x.to(dtype) for x in (q, k, v, g, beta)]
        o_lo, S_lo = kda_naive(*(x.double() for x in xs), initial_state=S0.float(), output_final_state=True)
        o, S = decode(*xs, S0.float())
        assert o.dtype == dtype and S.dtype == torch.float32
        # o is rounded to the input dtype on the way out; the state never is (fp32 accumulation)
        assert rel_rms(o, o_lo) <= tol and rel_rms(S, S_lo) <= 1e-5
    assert rel_rms(decode(q, k, v, g, beta, S0)[0], o_ref) <= 1e-12


def test_step_leaves_the_given_state_untouched_and_keeps_its_shape():
    q, k, v, g, beta = (x[:, 0] for x in make_inputs(2, 1, 3, 8, 4, dtype=torch.float32))
    state = torch.randn(2, 3, 8, 4)
    before = state.clone()
    o, new = kda_step(q, k, v, g, beta, state)
    assert torch.equal(state, before)
    assert o.shape == (2, 3, 4) and new.shape == state.shape and new.dtype == torch.float32


def test_step_scale_matches_naive():
    q, k, v, g, beta = make_inputs(1, 1, 2, 8, 4)
    S0 = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    o_ref, _ = kda_naive(q, k, v, g, beta, scale=0.3, initial_state=S0)
    o, _ = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0, scale=0.3)
    assert rel_rms(o, o_ref[:, 0]) <= 1e-14


def _step_args(N=2, H=3, K=8, V=4):
    q, k, v, g, beta = (x[:, 0] for x in make_inputs(N, 1, H, K, V, dtype=torch.float32))
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=torch.zeros(N, H, K, V))


@pytest.mark.parametrize("name, bad, match", [
    ("q", torch.zeros(2, 1, 3, 8), r"q must be 3-D \[N, H, K\]"),
    ("k", torch.zeros(2, 3, 7), r"k must have shape \[2, 3, 8\] to match q \[2, 3, 8\] and v \[2, 3, 4\], "
                                r"got \[2, 3, 7\]"),
    ("v", torch.zeros(2, 3), r"v must be 3-D"),
    ("g", torch.zeros(2, 3, 8, 1), r"g must be 3-D"),
    ("beta", torch.zeros(2, 3, 1), r"beta must be 2-D \[N, HV\]"),
    ("beta", torch.zeros(2, 4), r"beta must have shape \[2, 3\] to match q \[2, 3, 8\] and v \[2, 3, 4\], "
                                r"got \[2, 4\]"),
    ("state", torch.zeros(2, 3, 8, 5), r"state must have shape \[N, HV, K, V\] = \[2, 3, 8, 4\], got \[2, 3, 8, 5\]"),
    ("state", torch.zeros(3, 8, 4), r"state must be 4-D"),
    ("state", None, r"state must be 4-D .* got NoneType"),
    ("g", torch.full((2, 3, 8), 0.5), r"g is a log-decay and must be <= 0: .* got max 0.5"),
    ("q", torch.zeros(2, 3, 8, dtype=torch.long), r"q must be a floating-point tensor"),
])
def test_step_rejects_bad_input(name, bad, match):
    args = _step_args()
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        kda_step(**args)


@pytest.mark.parametrize("unchecked", [False, True], ids=["kda_step", "step_unchecked"])
@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_step_options_and_gva_equal_naive(option_set, unchecked, path):
    """kda_step, and the layer's decode path (the same without the checks), against the oracle."""
    step = step_unchecked if unchecked else kda_step
    xs, opts = make_raw_inputs(2, 6, 1, 3, 8, 4, option_set)
    xs[3][0, 2] = -torch.inf if not opts.get("use_gate_in_kernel") else xs[3][0, 2]  # a reset on the way
    v_first = opts.get("state_v_first", False)
    S0 = torch.randn(2, 3, *((4, 8) if v_first else (8, 4)), dtype=torch.float64)
    o_ref, S_ref = kda_naive(*xs, initial_state=S0, output_final_state=True, **opts)
    outs, S = [], S0
    for t in range(6):
        o, S = step(*(x[:, t] for x in xs), S, **opts)
        outs.append(o)
    assert S.shape == S0.shape
    assert rel_rms(torch.stack(outs, 1), o_ref) <= 1e-12 and rel_rms(S, S_ref) <= 1e-12


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_inplace_step_equals_naive_and_writes_the_given_state(dtype, tol, v_first, path):
    """V = 136: full column blocks of the fused kernel (128 fp32 / 64 fp64 wide) and a partial one; GVA."""
    xs, opts = make_raw_inputs(3, 5, 2, 4, 24, 136, "all_v_first" if v_first else "safe_gate", dtype=dtype)
    S0 = torch.randn(3, 4, *((136, 24) if v_first else (24, 136)), dtype=dtype)
    o_ref, S_ref = kda_naive(*(x.double() for x in xs), initial_state=S0.double(), output_final_state=True, **opts)
    S, outs = S0.clone(), []
    for t in range(5):
        o, new = kda_step(*(x[:, t] for x in xs), S, inplace=True, **opts)
        assert new is S
        outs.append(o)
    assert rel_rms(torch.stack(outs, 1), o_ref) <= tol and rel_rms(S, S_ref) <= tol
    o, new = kda_step(*(x[:, 0] for x in xs), S0, **opts)  # the default leaves S0 alone
    assert new is not S0 and rel_rms(o, o_ref[:, 0]) <= tol


@pytest.mark.parametrize("unchecked", [False, True], ids=["kda_step", "step_unchecked"])
def test_inplace_step_with_a_bad_gate_writes_nothing(unchecked):
    """The checks (kda_step), or the fused kernel reading g (both), refuse before the state is touched."""
    if unchecked and not fused_step.available():
        pytest.skip("only the fused kernel checks the gate without a sync")
    step = step_unchecked if unchecked else kda_step
    args = _step_args(K=8, V=136)
    args["state"].normal_()
    before = args["state"].clone()
    for bad, match in ((0.5, r"g is a log-decay and must be <= 0"), (float("nan"), r"g must not be NaN")):
        args["g"][1, 2, 3] = bad
        with pytest.raises(ValueError, match=match):
            step(**args, inplace=True)
        assert torch.equal(args["state"], before)


@pytest.mark.parametrize("state, match", [
    (torch.zeros(2, 3, 4, 8).transpose(-1, -2), r"compute dtype torch.float32, got torch.float32, non-contiguous"),
    (torch.zeros(2, 3, 8, 4, dtype=torch.bfloat16), r"compute dtype torch.float32, got torch.bfloat16"),
], ids=["non-contiguous", "bf16"])
def test_inplace_step_needs_a_contiguous_state_in_the_compute_dtype(state, match):
    with pytest.raises(ValueError, match=match):
        kda_step(**{**_step_args(), "state": state}, inplace=True)


def test_step_with_autograd_runs_the_differentiable_formula():
    xs, _ = make_raw_inputs(2, 1, 2, 2, 8, 4, "l2norm")
    q, k, v, g, beta = (x[:, 0].clone().requires_grad_() for x in xs)
    S0 = torch.randn(2, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    o, S = kda_step(q, k, v, g, beta, S0)
    o_ref, S_ref = kda_naive(*(x[:, None] for x in (q, k, v, g, beta)), initial_state=S0, output_final_state=True)
    grads = torch.autograd.grad((o * o).sum() + S.sum(), (q, k, v, g, beta, S0))
    grads_ref = torch.autograd.grad((o_ref * o_ref).sum() + S_ref.sum(), (q, k, v, g, beta, S0))
    assert all(rel_rms(a, b) <= 1e-12 for a, b in zip(grads, grads_ref, strict=True))


@pytest.mark.parametrize("compiler, match", [("no-such-compiler", r"no C\+\+ compiler"),
                                             ("false", r"building the fused KDA step failed")])
def test_fused_kernel_falls_back_when_it_cannot_be_built(monkeypatch, tmp_path, compiler, match):
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("K3SYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fused_step, "_library", functools.cache(fused_step._library.__wrapped__))
    with pytest.warns(UserWarning, match=match):
        assert not fused_step.available()
    args = _step_args()
    o_ref, S_ref = kda_naive(*(x[:, None] for x in list(args.values())[:5]), initial_state=args["state"],
                             output_final_state=True)
    o, S = kda_step(**args)  # the torch formula
    assert rel_rms(o, o_ref[:, 0]) <= 1e-6 and rel_rms(S, S_ref) <= 1e-6
