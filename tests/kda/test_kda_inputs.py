"""Bad input at every KDA entry point (naive, chunk on both backends, step, layer): one rule, a ValueError
that names the argument, never a crash or an answer computed from something the checks did not read."""

import os

import pytest
import torch
from kda_inputs import make_inputs

from k3sys.kda import KimiDeltaAttention, kda_chunk, kda_naive, kda_step
from k3sys.kda.validate import MAX_HEAD_DIM

HAS_TRITON = True
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton  # noqa: F401
except ImportError:
    HAS_TRITON = False

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed"))]


def _varlen(T=40, H=2, K=32, N=2):
    q, k, v, g, beta = make_inputs(1, T, H, K, K, dtype=torch.float32, gate="safe")
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=torch.randn(N, H, K, K))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu, cu_cpu", [([0, 10, 50], [0, 10, 40]), ([0, 10, 40], [0, 20, 40]),
                                        ([0, 10, 40], [0, 40])], ids=["device-past-T", "both-valid", "lengths"])
def test_cu_seqlens_and_its_host_copy_must_agree(backend, cu, cu_cpu):
    # the repro: the triton backend read the device copy past T (SIGSEGV in the interpreter), torch
    # raised IndexError; two valid but different copies gave answers 0.87 apart from FlashKDA's
    with pytest.raises(ValueError, match=r"cu_seqlens and cu_seqlens_cpu must be the same offsets"):
        kda_chunk(**_varlen(), cu_seqlens=torch.tensor(cu), cu_seqlens_cpu=torch.tensor(cu_cpu), backend=backend)


@pytest.mark.parametrize("op", [kda_naive, kda_chunk], ids=["naive", "chunk"])
def test_agreeing_copies_and_the_host_copy_alone_give_the_same_answer(op):
    args, cu = _varlen(), torch.tensor([0, 10, 40])
    o_dev, S_dev = op(**args, cu_seqlens=cu, output_final_state=True)
    o_both, S_both = op(**args, cu_seqlens=cu.clone(), cu_seqlens_cpu=cu.clone(), output_final_state=True)
    o_cpu, S_cpu = op(**args, cu_seqlens_cpu=cu.clone(), output_final_state=True)
    for o, S in ((o_both, S_both), (o_cpu, S_cpu)):
        assert torch.equal(o, o_dev) and torch.equal(S, S_dev)


def test_layer_names_cu_seqlens_that_do_not_cover_x():
    layer = KimiDeltaAttention(64, 2, 32)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at T=10, got 0 \.\.\. 9"):
        layer(torch.randn(1, 10, 64), cu_seqlens=torch.tensor([0, 4, 9]))


def test_layer_names_the_source_of_a_nan():
    torch.manual_seed(0)
    layer, x = KimiDeltaAttention(64, 2, 32), torch.randn(1, 10, 64)
    x_bad = x.clone()
    x_bad[0, 3, 5] = torch.nan
    with pytest.raises(ValueError, match=r"x \(the layer's input\) contains NaN at 1 of 640 elements"):
        layer(x_bad)
    for name in ("f_proj.0.weight", "A_log"):  # a loaded checkpoint's bad tensor, named as in state_dict()
        bad = KimiDeltaAttention(64, 2, 32)
        with torch.no_grad():
            bad.get_parameter(name).view(-1)[0] = torch.nan
        with pytest.raises(ValueError, match=rf"parameter {name} contains NaN at 1 of"):
            bad(x)


def test_step_refuses_an_integer_state():
    q, k, v, g, beta = (x[:, 0] for x in make_inputs(2, 1, 2, 8, 8))
    with pytest.raises(ValueError, match=r"state must be a floating-point tensor, got torch.int64"):
        kda_step(q, k, v, g, beta, torch.zeros(2, 2, 8, 8, dtype=torch.long))


@pytest.mark.parametrize("op", ["naive", "chunk", "step"])
def test_one_head_dim_limit_for_every_entry_point(op):
    K = MAX_HEAD_DIM * 2
    q, k, v, g, beta = make_inputs(1, 2, 1, K, 4)
    with pytest.raises(ValueError, match=rf"expected K, V <= {MAX_HEAD_DIM}, got K={K}, V=4"):
        if op == "step":
            kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], torch.zeros(1, 1, K, 4))
        else:
            {"naive": kda_naive, "chunk": kda_chunk}[op](q, k, v, g, beta)
