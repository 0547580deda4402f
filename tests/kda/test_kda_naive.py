import pytest
import torch
import torch.nn.functional as F
from kda_inputs import OPTION_SETS, make_inputs, make_raw_inputs

from k3sys.kda import kda_gate, kda_naive


def explicit_loop(q, k, v, g, beta, scale, S0):
    """The recurrence exactly as written in the paper, one (sequence, head, token) at a time, fp64."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    S_out = torch.zeros_like(S0)
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone()
            for t in range(T):
                kt, vt, bt = k[b, t, h], v[b, t, h], beta[b, t, h]
                S = (torch.eye(K, dtype=torch.float64) - bt * torch.outer(kt, kt)) @ torch.diag(g[b, t, h].exp()) @ S
                S = S + bt * torch.outer(kt, vt)
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            S_out[b, h] = S
    return o, S_out


@pytest.mark.parametrize("gate", ["safe", "plain"])
def test_naive_matches_the_explicit_recurrence(gate):
    q, k, v, g, beta = make_inputs(2, 20, 2, 6, 5, gate=gate)
    S0 = torch.randn(2, 2, 6, 5, dtype=torch.float64)
    o_ref, S_ref = explicit_loop(q, k, v, g, beta, 0.7, S0)
    o, S = kda_naive(q, k, v, g, beta, scale=0.7, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)


def test_naive_varlen_is_each_sequence_alone():
    q, k, v, g, beta = make_inputs(1, 30, 2, 6, 5)
    cu = torch.tensor([0, 4, 21, 30])
    S0 = torch.randn(3, 2, 6, 5, dtype=torch.float64)
    o, S = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for n in range(3):
        s, e = cu[n].item(), cu[n + 1].item()
        o_ref, S_ref = explicit_loop(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], 6 ** -0.5, S0[n:n + 1])
        torch.testing.assert_close(o[:, s:e], o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(S[n:n + 1], S_ref, rtol=1e-12, atol=1e-12)


def test_gates_follow_their_formulas_and_ranges():
    f, A_log, dt_bias = torch.randn(3, 7, 2, 4) * 4, torch.randn(2), torch.randn(2, 4)
    A = A_log.exp()[:, None]
    torch.testing.assert_close(kda_gate(f, A_log, dt_bias), -A * F.softplus(f + dt_bias))
    safe = kda_gate(f, A_log, dt_bias, lower_bound=-3.0)
    torch.testing.assert_close(safe, -3.0 * torch.sigmoid(A * (f + dt_bias)))
    assert safe.dtype == torch.float32 and (safe >= -3.0).all() and (safe <= 0).all()
    assert kda_gate(f.double(), A_log, dt_bias).dtype == torch.float64
    assert kda_gate(f.bfloat16(), A_log, dt_bias).dtype == torch.float32


@pytest.mark.parametrize("args, match", [
    ({"A_log": torch.zeros(3)}, r"A_log must have shape \[H\] = \[2\], got \[3\]"),
    ({"dt_bias": torch.zeros(2, 5)}, r"dt_bias must have shape \[H, K\] = \[2, 4\] or \[H \* K\] = \[8\], "
                                     r"got \[2, 5\]"),
    ({"A_log": None}, r"A_log is required for the softplus gate"),
    ({"lower_bound": -5.5}, r"lower_bound must be None or in \[-5, 0\), got -5.5"),
    ({"lower_bound": 0.5}, r"lower_bound must be None or in \[-5, 0\), got 0.5"),
])
def test_gate_rejects_bad_input(args, match):
    kw = {"f": torch.zeros(3, 2, 4), "A_log": torch.zeros(2), "dt_bias": torch.zeros(2, 4), **args}
    with pytest.raises(ValueError, match=match):
        kda_gate(**kw)


def by_hand(xs, opts):
    """The options' activations written out from fla's documentation, fp64, q/k expanded to HV heads."""
    q, k, v, g, beta = xs
    HV, K = g.shape[2], g.shape[3]
    if opts.get("use_qk_l2norm_in_kernel"):
        q, k = (x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    if opts.get("use_gate_in_kernel"):
        x = g + opts["dt_bias"].double().view(HV, K)
        A = opts["A_log"].double().exp()[:, None] if "A_log" in opts else 1.0
        g = -A * F.softplus(x) if opts.get("lower_bound") is None else opts["lower_bound"] * torch.sigmoid(A * x)
    if opts.get("use_beta_sigmoid_in_kernel"):
        beta = (2.0 if opts.get("allow_neg_eigval") else 1.0) / (1 + torch.exp(-beta))
    G = HV // q.shape[2]
    return q.repeat_interleave(G, 2), k.repeat_interleave(G, 2), v, g, beta


@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_naive_options_equal_the_activations_by_hand_gva(option_set):
    xs, opts = make_raw_inputs(2, 12, 1, 2, 6, 5, option_set)
    S0 = torch.randn(2, 2, 6, 5, dtype=torch.float64)
    v_first = opts.get("state_v_first", False)
    o_ref, S_ref = explicit_loop(*by_hand(xs, opts), 0.7, S0)
    o, S = kda_naive(*xs, scale=0.7, initial_state=S0.mT if v_first else S0, output_final_state=True, **opts)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S.mT if v_first else S, S_ref, rtol=1e-12, atol=1e-12)


def test_minus_inf_gate_is_an_exact_reset():
    q, k, v, g, beta = make_inputs(1, 20, 2, 6, 5)
    g[0, 8] = -torch.inf  # every channel of both heads: the state before token 8 is forgotten
    S0 = torch.randn(1, 2, 6, 5, dtype=torch.float64)
    o, S = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    g_after = g[:, 8:].clone()
    g_after[:, 0] = 0.0
    o_ref, S_ref = explicit_loop(q[:, 8:], k[:, 8:], v[:, 8:], g_after, beta[:, 8:], 6 ** -0.5, torch.zeros_like(S0))
    torch.testing.assert_close(o[:, 8:], o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)


def test_empty_inputs_and_empty_sequences_pass_the_state_through():
    q, k, v, g, beta = make_inputs(1, 10, 2, 6, 5)
    S0 = torch.randn(4, 2, 6, 5, dtype=torch.float64)
    cu = torch.tensor([0, 0, 10, 10, 10])
    o, S, h = kda_naive(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                        return_intermediate_states=True, chunk_size=4)
    o1, S1 = kda_naive(q, k, v, g, beta, initial_state=S0[1:2], output_final_state=True)
    assert torch.equal(o, o1) and torch.equal(S[1:2], S1)
    assert torch.equal(S[[0, 2, 3]], S0[[0, 2, 3]])
    assert h.shape == (1, 3, 2, 6, 5) and torch.equal(h[0, 0], S0[1])  # chunks of 4 tokens: 0, 4, 8
    _, S4 = kda_naive(*(x[:, :4] for x in (q, k, v, g, beta)), initial_state=S0[1:2], output_final_state=True)
    torch.testing.assert_close(h[0, 1], S4[0], rtol=1e-14, atol=1e-14)
    o0, S0_out = kda_naive(*(x[:, :0] for x in (q, k, v, g, beta)), initial_state=S0[:1], output_final_state=True)
    assert o0.shape == (1, 0, 2, 5) and torch.equal(S0_out, S0[:1])
