import pytest
import torch
import torch.nn.functional as F
from kda_inputs import make_inputs

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
    ({"dt_bias": torch.zeros(2, 5)}, r"dt_bias must have shape \[H, K\] = \[2, 4\], got \[2, 5\]"),
    ({"lower_bound": -5.5}, r"lower_bound must be None or in \[-5, 0\), got -5.5"),
    ({"lower_bound": 0.5}, r"lower_bound must be None or in \[-5, 0\), got 0.5"),
])
def test_gate_rejects_bad_input(args, match):
    kw = {"f": torch.zeros(3, 2, 4), "A_log": torch.zeros(2), "dt_bias": torch.zeros(2, 4), **args}
    with pytest.raises(ValueError, match=match):
        kda_gate(**kw)
