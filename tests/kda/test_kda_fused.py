"""The fused C++ forward of kda_chunk (chunk_fused.py) against the fp64 oracle, where it runs and where it must not."""

import pytest
import torch
from kda_inputs import GATES, OPTION_SETS, make_inputs, make_raw_inputs, rel_rms

from k3sys.kda import chunk_fused, kda_chunk, kda_naive
from k3sys.kda.validate import NaNError

pytestmark = pytest.mark.skipif(chunk_fused._library() is None, reason="no C++ compiler: the kernel cannot be built")


@pytest.fixture
def fused_calls(monkeypatch) -> list[bool]:
    """Records, per kda_chunk call, whether the fused kernel ran (True) or the torch path (False)."""
    calls, real = [], chunk_fused.runs_fused

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr("k3sys.kda.chunk.runs_fused", spy)
    return calls


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("T, K, V", [(1, 16, 16), (17, 20, 33), (100, 64, 48), (300, 128, 128)])
def test_fused_matches_oracle(fused_calls, gate, T, K, V):
    """Unaligned K and V, partial chunks, a nonzero initial state, every gate (the huge one takes the pairwise
    blocks and exact resets): the fp32 kernel within the fp32 tolerance of the fp64 oracle."""
    x = make_inputs(2, T, 3, K, V, torch.float32, gate, seed=T)
    if gate == "huge":
        x[3][0, T // 2, 1] = -torch.inf  # an exact reset
    S0 = torch.randn(2, 3, K, V, generator=torch.Generator().manual_seed(1))
    o, S = kda_chunk(*x, initial_state=S0, output_final_state=True)
    o_ref, S_ref = kda_naive(*(t.double() for t in x), initial_state=S0.double(), output_final_state=True)
    assert fused_calls == [True]
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5
    assert torch.equal(S0, torch.randn(2, 3, K, V, generator=torch.Generator().manual_seed(1)))  # not written


def test_fused_varlen_bf16_and_activations(fused_calls):
    """Packed sequences (one empty), bf16 inputs and fla's in-op activations through the fused path."""
    torch.manual_seed(0)
    T, H, K, V = 90, 2, 32, 32
    q, k, f = (torch.randn(1, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    v, b = torch.randn(1, T, H, V, dtype=torch.bfloat16), torch.randn(1, T, H, dtype=torch.bfloat16)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=torch.randn(H), dt_bias=torch.randn(H * K),
                lower_bound=-5.0, safe_gate=True, use_beta_sigmoid_in_kernel=True)
    cu, S0 = torch.tensor([0, 40, 40, 90]), torch.randn(3, H, K, V)
    o, S = kda_chunk(q, k, v, f, b, initial_state=S0, output_final_state=True, cu_seqlens=cu, **opts)
    o_ref, S_ref = kda_naive(q, k, v, f, b, initial_state=S0, output_final_state=True, cu_seqlens=cu, **opts)
    assert fused_calls == [True] and o.dtype == torch.bfloat16
    assert rel_rms(o, o_ref) <= 5e-3 and rel_rms(S, S_ref) <= 1e-5
    assert torch.equal(S[1], S0[1])  # the empty sequence passes its state through


def test_torch_path_where_the_kernel_cannot_serve(fused_calls):
    """Autograd, fp64, chunk_size 32 and intermediate states take the torch path, with the same answers."""
    x = make_inputs(1, 50, 2, 16, 16, torch.float32)
    o_fused, _ = kda_chunk(*x)
    leaves = [t.clone().requires_grad_() for t in x]
    o_grad, _ = kda_chunk(*leaves)
    o_grad.sum().backward()
    kda_chunk(*(t.double() for t in x))
    kda_chunk(*x, chunk_size=32)
    kda_chunk(*x, return_intermediate_states=True)
    assert fused_calls == [True, False, False, False, False]
    assert rel_rms(o_fused, o_grad.detach()) <= 1e-6 and leaves[0].grad is not None


@pytest.mark.parametrize("option_set", sorted(OPTION_SETS))
@pytest.mark.parametrize("flat_dt_bias", [True, False])
def test_fused_in_op_activations(fused_calls, option_set, flat_dt_bias):
    """fla's option sets with grouped value heads (HV = 2H): the kernel's own l2 norms, bounded gate and
    sigmoid (the softplus gate applied in torch first) within the fp32 tolerance of the fp64 oracle."""
    xs, opts = make_raw_inputs(1, 70, 2, 4, 32, 24, option_set, torch.float32, flat_dt_bias=flat_dt_bias)
    S0 = torch.randn(1, 4, 24, 32) if opts.get("state_v_first") else torch.randn(1, 4, 32, 24)
    o, S = kda_chunk(*xs, initial_state=S0, output_final_state=True, **opts)
    o_ref, S_ref = kda_naive(*(t.double() for t in xs), initial_state=S0.double(), output_final_state=True, **opts)
    assert fused_calls == [True]
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


def test_fused_gate_nan_is_named():
    """A NaN gate input under the in-kernel bounded gate raises the same NaNError as the torch path."""
    xs, opts = make_raw_inputs(1, 40, 2, 2, 16, 16, "safe_gate", torch.float32)
    xs[3][0, 33, 1, 5] = float("nan")
    with pytest.raises(NaNError, match="g must not be NaN"):
        kda_chunk(*xs, **opts)
