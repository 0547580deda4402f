"""Single-process MoELayer and grouped GEMMs against dense fp64 references."""

from __future__ import annotations

import pytest
import torch

import k3sys.ep as ep
from k3sys.ep import MoELayer, grouped_mm, grouped_swiglu


def dense_moe(layer: MoELayer, x_sh: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then pick each token's top-K: no sorting, grouping or scatter."""
    logits_se = x_sh @ layer.router.weight.T
    scores_se = logits_se.softmax(-1) if layer.router_kind == "softmax" else logits_se.sigmoid()
    w_sk, ids_sk = scores_se.topk(layer.top_k, dim=-1)
    w_sk = w_sk / w_sk.sum(-1, keepdim=True)
    gate_sef = torch.einsum("sh,ehf->sef", x_sh, layer.w_gate)
    h_sef = gate_sef * gate_sef.sigmoid() * torch.einsum("sh,ehf->sef", x_sh, layer.w_up)
    y_seh = torch.einsum("sef,efh->seh", h_sef, layer.w_down)
    out = (w_sk.unsqueeze(-1) * y_seh.gather(1, ids_sk.unsqueeze(-1).expand(-1, -1, x_sh.shape[1]))).sum(1)
    if layer.shared is not None:
        out = out + layer.shared(x_sh)
    return out


@pytest.mark.parametrize(
    ("E", "K", "shared", "router"),
    [(8, 2, 0, "softmax"), (8, 1, 1, "sigmoid"), (16, 4, 2, "softmax"), (4, 4, 0, "sigmoid")],
    ids=lambda v: str(v),
)
def test_local_layer_matches_dense_fp64(E: int, K: int, shared: int, router: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 24, E, K, num_shared_experts=shared, router=router).double()
    x = torch.randn(3, 37, 16, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out.square().sum(), [x, *params])
    x_ref = x.detach().clone().requires_grad_()
    ref = dense_moe(layer, x_ref.view(-1, 16)).view(x.shape)
    grads_ref = torch.autograd.grad(ref.square().sum(), [x_ref, *params])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


def test_routing_weights_normalised_and_ids_distinct() -> None:
    torch.manual_seed(1)
    for router in ("softmax", "sigmoid"):
        layer = MoELayer(8, 8, 6, 3, router=router)
        ids, w = layer.route(torch.randn(50, 8))
        assert ids.shape == w.shape == (50, 3)
        torch.testing.assert_close(w.sum(-1), torch.ones(50))
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()


def test_stats_report_load() -> None:
    torch.manual_seed(2)
    layer = MoELayer(8, 8, 4, 2)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = layer.router.weight[1, 0] = 100.0  # experts 0 and 1 take everything
    x = torch.randn(10, 8)
    x[:, 0] = 1.0
    assert layer.stats() is None  # before the first forward
    layer(x)
    st = layer.stats()
    assert st.slots_per_rank == (20,) and st.copies == 0 and st.moved_tokens == 0
    assert st.maxvio == pytest.approx(1.0)  # T = [10, 10, 0, 0]: max / mean - 1


@pytest.mark.parametrize("ends", [[3, 7, 10], [0, 7, 10], [2, 5, 7], [0, 0, 0]], ids=lambda e: "-".join(map(str, e)))
def test_grouped_mm_matches_per_group_products(ends: list[int]) -> None:
    torch.manual_seed(3)
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 16, 8, dtype=torch.float64, requires_grad=True)
    y = grouped_mm(x, w, ends)
    starts = [0, *ends[:-1]]
    ref = torch.zeros(10, 8, dtype=torch.float64)
    for g, (a, b) in enumerate(zip(starts, ends, strict=True)):
        ref[a:b] = x[a:b] @ w[g]
    assert torch.equal(y, ref)  # tail rows (past ends[-1]) are zeros too
    assert torch.autograd.gradcheck(lambda x, w: grouped_mm(x, w, ends), (x, w))
    # The same groups' weights as several tensors taken in order (an empty one included).
    parts = (w[:1], w[1:1], w[1:])
    assert torch.equal(grouped_mm(x, parts, ends), ref)
    assert torch.autograd.gradcheck(lambda x, *ws: grouped_mm(x, ws, ends), (x, *parts))


def test_grouped_mm_offsets_follow_torch_grouped_mm() -> None:
    """Our `ends` are torch._grouped_mm's `offs` (its CPU build runs the forward, enough to pin the convention)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm not in this torch")
    torch.manual_seed(4)
    x, w, ends = torch.randn(12, 16), torch.randn(3, 16, 8), [3, 3, 9]
    ref = torch._grouped_mm(x, w, offs=torch.tensor(ends, dtype=torch.int32))
    torch.testing.assert_close(grouped_mm(x, w, ends)[:9], ref[:9], rtol=0, atol=1e-6)


def test_grouped_swiglu_shapes_and_bad_ends() -> None:
    x, wg, wd = torch.randn(5, 4), torch.randn(2, 4, 6), torch.randn(2, 6, 4)
    assert grouped_swiglu(x, [2, 5], wg, wg, wd).shape == (5, 4)
    assert not grouped_swiglu(x, [], wg[:0], wg[:0], wd[:0]).any()  # no groups: every row is tail
    with pytest.raises(ValueError, match="ends has 3 groups but w has 2"):
        grouped_mm(x, wg, [1, 2, 3])
    with pytest.raises(ValueError, match="ends has 2 groups but w has 3"):
        grouped_mm(x, (wg, wg[:1]), [1, 2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "top_k must be >= 1, got 0"),
        ({"top_k": 9}, r"top_k \(9\) must be <= num_experts \(8\)"),
        ({"router": "relu"}, "router must be 'softmax' or 'sigmoid', got 'relu'"),
        ({"num_shared_experts": -1}, "num_shared_experts must be >= 0, got -1"),
    ],
    ids=["top_k-0", "top_k-gt-E", "router", "shared"],
)
def test_bad_constructor_args(kwargs: dict, match: str) -> None:
    args = {"hidden": 8, "ffn_hidden": 8, "num_experts": 8, "top_k": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        MoELayer(**args)


def test_bad_input_width() -> None:
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 8\] torch.float32 on cpu, got \[3, 7\]"):
        MoELayer(8, 8, 4, 2)(torch.randn(3, 7))


def test_meta_device_construction() -> None:
    with torch.device("meta"):
        layer = MoELayer(32, 64, 8, 2, num_shared_experts=1)
    assert layer.w_down.is_meta and layer.w_gate.shape == (8, 32, 64)


def test_exports() -> None:
    for name in ep.__all__:
        assert hasattr(ep, name)


def test_no_expert_ids_equal_zero_weight_pairs() -> None:
    """A -1 id (no expert) contributes nothing: the same as routing that slot to an unused expert with
    weight 0, whatever the -1 slot's weight (NaN here); its weight gets a zero gradient."""
    torch.manual_seed(6)
    layer = MoELayer(16, 24, 8, 3).double()
    x = torch.randn(40, 16, dtype=torch.float64)
    ids, w = layer.route(x)
    none = torch.rand(ids.shape) < 0.3
    none[0] = True  # a token with no expert at all
    free = torch.stack([torch.tensor([e for e in range(8) if e not in row][0]) for row in ids.tolist()])
    w = w.detach().requires_grad_()
    out = layer.routed_experts(x, ids.masked_fill(none, -1), w.masked_fill(none, float("nan")))
    assert not out[0].any() and layer.stats().slots_per_rank == (int((~none).sum()),)
    ref = layer.routed_experts(x, torch.where(none, free.view(-1, 1), ids), w.masked_fill(none, 0))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(out.sum(), w)
    assert torch.isfinite(g).all() and not g[none].any()
