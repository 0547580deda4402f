import functools

import pytest
import torch
from kda_inputs import OPTION_SETS, make_inputs, make_raw_inputs, option_grads, rel_rms

from k3sys.kda import kda_chunk, kda_naive
from k3sys.kda.chunk import SUB_CHUNK, _max_half_span

F64 = torch.float64


@functools.cache
def case(B, T, H, K, V, gate="safe", seed=0, cu=None):
    """Inputs, a random initial state and the fp64 naive result (cached: shared across chunk sizes)."""
    q, k, v, g, beta = make_inputs(B, T, H, K, V, gate=gate, seed=seed)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    S0 = torch.randn(N, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(seed + 1))
    o, S = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu_seqlens)
    return (q, k, v, g, beta), S0, cu_seqlens, o, S


@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 100, 1000])
def test_chunk_matches_naive_fp64(T, C):
    xs, S0, _, o_ref, S_ref = case(2, T, 2, 16, 8)
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, chunk_size=C)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10


@pytest.mark.parametrize("gate", ["plain", "huge"])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_chunk_matches_naive_with_unbounded_gate_fp64(gate, C):
    xs, S0, _, o_ref, S_ref = case(2, 150, 2, 16, 8, gate=gate)
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, chunk_size=C)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10


def test_huge_gate_sends_some_blocks_down_each_path():
    """The "huge" inputs must exercise both the factorised and the pairwise intra-block form."""
    (_, _, _, g, _), *_ = case(2, 150, 2, 16, 8, gate="huge")
    blocks = g[:, :144].reshape(2, 9, SUB_CHUNK, 2, 16)
    span = -blocks[:, :, 1:].sum(2).amax(-1)  # G_0 - G_last per block, widest channel
    for dtype in (torch.float32, F64):
        wide = span > 2 * _max_half_span(dtype)
        assert wide.any() and not wide.all(), dtype


@pytest.mark.parametrize("K, V", [(256, 256), (60, 20), (1, 3)])
def test_chunk_head_dims(K, V):
    xs, S0, _, o_ref, S_ref = case(1, 40, 2, K, V)
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("gate", ["safe", "plain", "huge"])
def test_chunk_fp32_relative_rms(gate, C):
    xs, S0, _, _, _ = case(1, 1000, 2, 32, 32, gate=gate)
    xs32 = [x.float() for x in xs]
    o_ref, S_ref = kda_naive(*(x.double() for x in xs32), initial_state=S0.float().double(), output_final_state=True)
    o, S = kda_chunk(*xs32, initial_state=S0.float(), output_final_state=True, chunk_size=C)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


def test_chunk_bf16_accumulates_in_fp32():
    xs, S0, _, _, _ = case(1, 1000, 2, 32, 32)
    xs16 = [x.bfloat16() for x in xs]
    o_ref, S_ref = kda_naive(*(x.double() for x in xs16), initial_state=S0.float().double(), output_final_state=True)
    o, S = kda_chunk(*xs16, initial_state=S0.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    # o is rounded to bf16 on the way out; the state never is (a bf16 state would be ~2e-3 off)
    assert rel_rms(o, o_ref) <= 5e-3 and rel_rms(S, S_ref) <= 1e-5


@pytest.mark.parametrize("C", [16, 32])
@pytest.mark.parametrize("cu_dtype", [torch.int64, torch.int32])
def test_varlen_equals_each_sequence_alone(C, cu_dtype):
    lengths = [17, 1, 100, 16, 33, 15]  # uneven, unsorted: sequences leave the carried batch at different steps
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    xs, S0, _, o_ref, S_ref = case(1, cu[-1], 2, 16, 8, cu=cu)
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, cu_seqlens=torch.tensor(cu, dtype=cu_dtype),
                     chunk_size=C)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10
    for n in range(len(lengths)):
        s, e = cu[n], cu[n + 1]
        o_n, S_n = kda_chunk(*(x[:, s:e] for x in xs), initial_state=S0[n:n + 1], output_final_state=True,
                             chunk_size=C)
        assert rel_rms(o[:, s:e], o_n) <= 1e-12 and rel_rms(S[n:n + 1], S_n) <= 1e-12


@pytest.mark.parametrize("split", [7, 16, 50, 99])
def test_state_round_trip_across_two_calls(split):
    xs, S0, _, o_ref, S_ref = case(2, 100, 2, 16, 8)
    o1, S1 = kda_chunk(*(x[:, :split] for x in xs), initial_state=S0, output_final_state=True)
    o2, S2 = kda_chunk(*(x[:, split:] for x in xs), initial_state=S1, output_final_state=True)
    assert rel_rms(torch.cat([o1, o2], dim=1), o_ref) <= 1e-10 and rel_rms(S2, S_ref) <= 1e-10


def test_defaults_scale_and_no_final_state():
    xs, _, _, _, _ = case(2, 20, 2, 16, 8)
    o, S = kda_chunk(*xs)
    o_ref, _ = kda_naive(*xs)
    assert S is None and rel_rms(o, o_ref) <= 1e-10
    o_s, _ = kda_chunk(*xs, scale=0.5)
    o_s_ref, _ = kda_naive(*xs, scale=0.5)
    assert rel_rms(o_s, o_s_ref) <= 1e-10 and rel_rms(o_s, o) > 1e-3


def _grads(fn, xs, S0, cu, **kw):
    leaves = [x.clone().requires_grad_() for x in (*xs, S0)]
    o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
        S * torch.randn(S.shape, generator=gen, dtype=S.dtype)).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("cu", [None, (0, 9, 30, 45)], ids=["batch", "varlen"])
@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("gate", ["safe", "huge"])
def test_gradients_match_naive_fp64(gate, C, cu):
    xs, S0, cu_t, _, _ = case(1 if cu else 2, 45, 2, 8, 6, gate=gate, cu=cu)
    ref = _grads(kda_naive, xs, S0, cu_t)
    got = _grads(kda_chunk, xs, S0, cu_t, chunk_size=C)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, ref, strict=True):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-10, name


def test_bf16_backward_is_finite_in_input_dtypes():
    xs, S0, _, _, _ = case(2, 40, 2, 16, 8)
    leaves = [x.bfloat16().requires_grad_() for x in xs] + [S0.float().requires_grad_()]
    o, S = kda_chunk(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    (o.float().sum() + S.sum()).backward()
    for x in leaves:
        assert x.grad.dtype == x.dtype and torch.isfinite(x.grad).all()


def _args(B=1, T=8, H=2, K=4, V=3):
    q, k, v, g, beta = make_inputs(B, T, H, K, V, dtype=torch.float32)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


BAD = [
    ({"q": torch.zeros(1, 8, 2)}, r"q must be 4-D \[B, T, H, \*\], got 3-D"),
    ({"k": torch.zeros(1, 8, 2, 5)}, r"k must have shape \[B, T, H, K\] = \[1, 8, 2, 4\], got \[1, 8, 2, 5\]"),
    ({"v": torch.zeros(1, 7, 2, 3)}, r"v must have shape \[B, T, HV, V\]"),
    ({"g": torch.zeros(1, 8, 4, 4)}, r"g must have shape \[B, T, HV, K\]"),
    ({"beta": torch.zeros(1, 8, 2, 1)}, r"beta must have shape \[B, T, HV\] = \[1, 8, 2\]"),
    ({"q": torch.zeros(1, 8, 2, 4, dtype=torch.int32)}, r"q must be a floating-point tensor"),
    ({"g": torch.full((1, 8, 2, 4), 0.25)}, r"g is a log-decay and must be <= 0: each step scales the state by "
                                            r"exp\(g\), .* got max 0.25"),
    ({"g": torch.full((1, 8, 2, 4), torch.inf)}, r"g is a log-decay and must be <= 0: .* got max inf"),
    ({"g": torch.full((1, 8, 2, 4), torch.nan)}, r"g must not be NaN"),
    ({"v": torch.zeros(1, 8, 3, 3)}, r"v's heads HV=3 must be a multiple of q/k's heads H=2"),
    ({"allow_neg_eigval": True}, r"allow_neg_eigval=True .* needs use_beta_sigmoid_in_kernel=True"),
    ({"use_gate_in_kernel": True}, r"use_gate_in_kernel=True needs A_log .* or lower_bound"),
    ({"use_gate_in_kernel": True, "A_log": torch.zeros(2), "safe_gate": True, "lower_bound": -6.0},
     r"lower_bound must be None or in \[-5, 0\), got -6.0"),
    ({"A_log": torch.zeros(2)}, r"A_log / dt_bias are only used with use_gate_in_kernel=True"),
    ({"initial_state": torch.zeros(1, 2, 4, 3), "state_v_first": True},
     r"initial_state must have shape \[N, HV, V, K\] \(state_v_first\) = \[1, 2, 3, 4\]"),
    ({"initial_state": torch.zeros(1, 2, 4, 4)}, r"initial_state must have shape \[N, HV, K, V\] = \[1, 2, 4, 3\]"),
    ({"initial_state": torch.zeros(2, 2, 4, 3), "cu_seqlens": torch.tensor([0, 3, 5, 8])},
     r"initial_state must have shape \[N, HV, K, V\] = \[3, 2, 4, 3\], got \[2, 2, 4, 3\]"),
    ({"cu_seqlens": torch.tensor([1, 8])}, r"cu_seqlens must start at 0 and end at T=8, got 1 \.\.\. 8"),
    ({"cu_seqlens": torch.tensor([0, 7])}, r"cu_seqlens must start at 0 and end at T=8, got 0 \.\.\. 7"),
    ({"cu_seqlens": torch.tensor([0, 6, 3, 8])}, r"cu_seqlens must be non-decreasing, got \[0, 6, 3, 8\]"),
    ({"cu_seqlens": torch.tensor([0.0, 8.0])}, r"cu_seqlens must be a 1-D int64 tensor, got torch.float32"),
    ({"cu_seqlens": torch.tensor([8])}, r"cu_seqlens needs at least 2 entries"),
]


@pytest.mark.parametrize("op", [kda_naive, kda_chunk], ids=["naive", "chunk"])
@pytest.mark.parametrize("override, match", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_rejected(op, override, match):
    with pytest.raises(ValueError, match=match):
        op(**{**_args(), **override})


@pytest.mark.parametrize("op", [kda_naive, kda_chunk], ids=["naive", "chunk"])
def test_cu_seqlens_needs_batch_one(op):
    with pytest.raises(ValueError, match=r"cu_seqlens packs sequences along T, so B must be 1, got B=2"):
        op(**_args(B=2), cu_seqlens=torch.tensor([0, 8]))


def test_chunk_rejects_big_heads_and_bad_chunk_size():
    with pytest.raises(ValueError, match=r"expected K, V <= 512, got K=513, V=3"):
        kda_chunk(**_args(K=513))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['use_l2norm'\]"):
        kda_chunk(**_args(), use_l2norm=True)
    for bad in (0, 24, 2.0, True):
        with pytest.raises(ValueError, match=rf"chunk_size must be a positive int.*got {bad!r}"):
            kda_chunk(**_args(), chunk_size=bad)


@pytest.mark.parametrize("cu", [None, (0, 0, 20, 20, 37, 45, 45)], ids=["batch", "varlen-empty"])
@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_options_match_naive_fp64_gva(option_set, cu):
    B, H, HV, K, V = (1 if cu else 2), 2, 4, 8, 6
    xs, opts = make_raw_inputs(B, 45, H, HV, K, V, option_set, flat_dt_bias=cu is None)
    N = len(cu) - 1 if cu else B
    S0 = torch.randn(N, HV, *((V, K) if opts.get("state_v_first") else (K, V)), dtype=F64)
    cu_t = None if cu is None else torch.tensor(cu)
    o_ref, S_ref, ref = option_grads(kda_naive, xs, opts, S0, cu_t)
    o, S, got = option_grads(kda_chunk, xs, opts, S0, cu_t, chunk_size=32 if cu else 16)
    assert o.shape == (B, 45, HV, V) and S.shape == S0.shape
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10
    assert set(got) == set(ref) and len(got) == 6 + ("A_log" in opts) + ("dt_bias" in opts)
    for name in got:
        assert torch.isfinite(got[name]).all() and rel_rms(got[name], ref[name]) <= 1e-10, name


def test_head_dims_512_with_gradients():
    xs, opts = make_raw_inputs(1, 20, 1, 1, 512, 512, "l2norm")
    S0 = torch.randn(1, 1, 512, 512, dtype=F64)
    o_ref, S_ref, ref = option_grads(kda_naive, xs, opts, S0, None)
    o, S, got = option_grads(kda_chunk, xs, opts, S0, None)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10
    assert all(rel_rms(got[n], ref[n]) <= 1e-10 for n in got)


@pytest.mark.parametrize("C", [16, 32])
def test_minus_inf_gate_resets_with_gradients(C):
    xs, S0, _, _, _ = case(2, 45, 2, 8, 6)
    g = xs[3].clone()
    g[0, 20] = -torch.inf  # whole heads: an exact reset mid-chunk
    g[1, 3, 1, :4] = -torch.inf  # some channels of one head
    xs = (*xs[:3], g, xs[4])
    ref = _grads(kda_naive, xs, S0, None)
    got = _grads(kda_chunk, xs, S0, None, chunk_size=C)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, ref, strict=True):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-10, name
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, chunk_size=C)
    o_ref, S_ref = kda_naive(*xs, initial_state=S0, output_final_state=True)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10


@pytest.mark.parametrize("v_first", [False, True])
def test_no_tokens_passes_the_state_through(v_first):
    q, k, v, g, beta = (x[:, :0] for x in case(2, 4, 2, 8, 6)[0])
    S0 = torch.randn(2, 2, *((6, 8) if v_first else (8, 6)), dtype=F64)
    for op in (kda_naive, kda_chunk):
        o, S, h = op(q, k, v, g, beta, initial_state=S0, output_final_state=True, return_intermediate_states=True,
                     state_v_first=v_first)
        assert o.shape == (2, 0, 2, 6) and torch.equal(S, S0) and h.shape[:2] == (2, 0)
        _, S = op(q, k, v, g, beta, output_final_state=True)
        assert torch.equal(S, torch.zeros(2, 2, 8, 6, dtype=F64))
    _, S = kda_chunk(q[:1], k[:1], v[:1], g[:1], beta[:1], output_final_state=True, cu_seqlens=torch.tensor([0, 0, 0]))
    assert S.shape == (2, 2, 8, 6) and not S.any()


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("C", [16, 32])
@pytest.mark.parametrize("cu", [None, (0, 17, 17, 50, 64)], ids=["batch", "varlen-empty"])
def test_intermediate_states_match_naive(cu, C, v_first):
    xs, S0, cu_t, _, _ = case(1 if cu else 2, 64, 2, 8, 6, cu=cu)
    S0 = S0.mT if v_first else S0
    o, S, h = kda_chunk(*xs, initial_state=S0, output_final_state=True, cu_seqlens=cu_t, chunk_size=C,
                        return_intermediate_states=True, state_v_first=v_first)
    o_ref, S_ref, h_ref = kda_naive(*xs, initial_state=S0, output_final_state=True, cu_seqlens=cu_t, chunk_size=C,
                                    return_intermediate_states=True, state_v_first=v_first)
    chunks = 64 // C if cu is None else sum(-(-(b - a) // C) for a, b in zip(cu, cu[1:], strict=False))
    assert h.shape == ((2, chunks) if cu is None else (1, chunks)) + (2, *S0.shape[-2:])
    assert rel_rms(h, h_ref) <= 1e-10 and rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10


def test_cu_seqlens_cpu_alone_or_beside_cu_seqlens():
    cu = (0, 9, 9, 30)
    xs, S0, cu_t, o_ref, S_ref = case(1, 30, 2, 8, 6, cu=cu)
    for kw in (dict(cu_seqlens=cu_t, cu_seqlens_cpu=cu_t.clone()), dict(cu_seqlens_cpu=cu_t)):
        o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, **kw)
        assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10


@pytest.mark.parametrize("op", [kda_chunk, kda_naive], ids=["chunk", "naive"])
def test_bf16_with_in_kernel_activations_holds_the_state_to_1e6(op):
    """The peers' accuracy: activations in fp32 inside the op, state vs the fp64 oracle fed the same bf16."""
    xs, opts = make_raw_inputs(1, 1000, 2, 2, 32, 32, "all_v_first", dtype=torch.bfloat16)
    S0 = torch.randn(1, 2, 32, 32)
    o, S = op(*xs, initial_state=S0, output_final_state=True, **opts)
    o_ref, S_ref = kda_naive(*(x.double() for x in xs), initial_state=S0.double(), output_final_state=True,
                             **{n: (x.double() if isinstance(x, torch.Tensor) else x) for n, x in opts.items()})
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_rms(S, S_ref) <= 1e-6 and rel_rms(o, o_ref) <= 5e-3


def test_flashkda_names_are_accepted():
    xs, opts = make_raw_inputs(1, 20, 2, 2, 8, 6, "all_v_first", flat_dt_bias=False)  # FlashKDA's dt_bias [HV, K]
    S0 = torch.randn(1, 2, 6, 8, dtype=F64)
    flash = {**{n: x for n, x in opts.items() if n != "state_v_first"}, "transpose_state_layout": True,
             "l2norm_eps": 1e-6}
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, **flash)
    o_ref, S_ref = kda_naive(*xs, initial_state=S0, output_final_state=True, **opts)
    assert rel_rms(o, o_ref) <= 1e-10 and rel_rms(S, S_ref) <= 1e-10
    with pytest.raises(ValueError, match="pass either state_v_first or its alias transpose_state_layout"):
        kda_chunk(*xs, state_v_first=True, transpose_state_layout=True)
