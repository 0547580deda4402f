"""Expert-parallel MoELayer (`apply_ep`, real gloo groups) against the single-process layer with the same weights."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
import torch.distributed as dist
from rank_pool import RankPool

from k3sys.ep import MoELayer, RemoteInputError, apply_ep

H, F, S = 16, 24, 48
ROUTER_BIAS = {"uniform": 0.0, "skewed": 1.15, "one-expert": 50.0}  # expert 0's bias: maxvio ~0, ~10, E/K-1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def build(group: dist.ProcessGroup, E: int, K: int, routing: str, router: str, shared: int):
    """Reference layer, its distributed twin, every rank's tokens (uneven counts, one rank may have 0)."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    ref = MoELayer(H, F, E, K, num_shared_experts=shared, router=router)
    with torch.no_grad():  # feature 0 is a constant 1, so router column 0 is a per-expert bias
        ref.router.weight[:, 0] = 0.0
        ref.router.weight[0, 0] = ROUTER_BIAS[routing]
    layer = apply_ep(copy.deepcopy(ref), group, S)
    sizes = [S, S // 2 + 3, 0, S - 5][:R] if R == 4 else [S - 11, S]
    x = torch.randn(sum(sizes), H)
    x[:, 0] = 1.0
    start = sum(sizes[:rank])
    return ref, layer, x, slice(start, start + sizes[rank])


def all_reduced(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def check_layer(group: dist.ProcessGroup, E: int, K: int, routing: str, router: str, shared: int) -> dict:
    rank = dist.get_rank(group)
    ref, layer, x_all, mine = build(group, E, K, routing, router, shared)
    g_all = torch.randn(x_all.shape)
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * g_all).sum().backward()
    x = x_all[mine].clone().requires_grad_()
    out = layer(x)
    (out * g_all[mine]).sum().backward()
    home = layer.home_experts()
    err = {
        "out": rel(out, out_ref[mine]),
        "x": rel(x.grad, x_ref.grad[mine]),
        "router": rel(all_reduced(layer.router.weight.grad, group), ref.router.weight.grad),
    }
    for name in ("w_gate", "w_up", "w_down"):
        err[name] = rel(getattr(layer, name).grad, getattr(ref, name).grad[home.start:home.stop])
    if shared:
        for name, p in layer.shared.named_parameters():
            err[f"shared.{name}"] = rel(all_reduced(p.grad, group), dict(ref.shared.named_parameters())[name].grad)
    st = layer.stats()
    total = sum(st.slots_per_rank)
    R = len(st.slots_per_rank)
    assert sorted(st.slots_per_rank, reverse=True) == [total // R + (r < total % R) for r in range(R)]
    return {"err": err, "maxvio": st.maxvio, "copies": st.copies, "rank": rank}


LAYER_CASES = [
    # (ranks, E, K, routing, router, shared experts)
    (2, 16, 2, "uniform", "softmax", 1),
    (2, 16, 2, "one-expert", "sigmoid", 0),
    (4, 32, 2, "skewed", "softmax", 1),
    (4, 32, 2, "one-expert", "softmax", 0),
    (4, 32, 4, "uniform", "sigmoid", 2),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"R{c[0]}-E{c[1]}-K{c[2]}-{c[3]}-{c[4]}-shared{c[5]}")
@pytest.mark.timeout(180)
def test_distributed_layer_matches_reference(ranks: RankPool, case: tuple) -> None:
    R, E, K, routing, *_ = case
    results = ranks.run(check_layer, E, K, routing, *case[4:], ranks=R)
    for res in results:
        assert all(e <= 1e-5 for e in res["err"].values()), res
    maxvio = results[0]["maxvio"]
    if routing == "skewed":
        assert 8 <= maxvio <= 12 and results[0]["copies"] > 0
    if routing == "one-expert":
        assert maxvio == pytest.approx(E / K - 1)


def check_sgd_steps(group: dist.ProcessGroup, steps: int) -> list[float]:
    """SGD updates of the distributed layer equal the reference's.

    Non-expert gradients are all-reduced here, as data parallelism would; expert gradients come out of
    the layer already complete (replica gradients reduced home).
    """
    ref, layer, x_all, mine = build(group, 32, 2, "skewed", "softmax", 1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.02)
    opt = torch.optim.SGD(layer.parameters(), lr=0.02)
    home = layer.home_experts()
    experts = ("w_gate", "w_up", "w_down")

    def params(module: MoELayer, own: bool) -> dict[str, torch.Tensor]:
        return {n: (p[home.start:home.stop] if own and n in experts else p).detach().clone()
                for n, p in module.named_parameters()}

    errs = []
    for _ in range(steps):
        before_ref, before = params(ref, True), params(layer, False)
        opt_ref.zero_grad()
        ref(x_all).square().sum().backward()
        opt_ref.step()
        opt.zero_grad()
        layer(x_all[mine]).square().sum().backward()
        for name, p in layer.named_parameters():
            if name not in experts:
                dist.all_reduce(p.grad, group=group)
        opt.step()
        after_ref, after = params(ref, True), params(layer, False)
        errs += [rel(after[n] - before[n], after_ref[n] - before_ref[n]) for n in after]
    return errs


@pytest.mark.timeout(180)
def test_optimizer_steps_equal_reference(ranks: RankPool) -> None:
    for errs in ranks.run(check_sgd_steps, 3):
        assert all(e <= 1e-5 for e in errs), errs  # also fails on NaN


def check_module_conversions(group: dist.ProcessGroup) -> list[float]:
    """`.double()` and meta-device construction + `.to_empty()` move the static buffers with the parameters."""
    ref, layer, x_all, mine = build(group, 16, 2, "skewed", "softmax", 1)
    ref, layer, x_all = ref.double(), layer.double(), x_all.double()
    assert layer.buffer.dtype == torch.float64
    errs = [rel(layer(x_all[mine]), ref(x_all)[mine])]
    with torch.device("meta"):
        meta = apply_ep(MoELayer(H, F, 16, 2, num_shared_experts=1), group, S)
    assert meta.w_gate.shape == (16 // dist.get_world_size(group), H, F)
    meta = meta.to_empty(device="cpu").double()
    meta.load_full_state_dict(ref.state_dict())
    assert meta.buffer.device == torch.device("cpu") and meta.buffer.dtype == torch.float64
    errs.append(rel(meta(x_all[mine]), ref(x_all)[mine]))
    return errs


@pytest.mark.timeout(60)
def test_buffers_follow_module_conversions(ranks: RankPool) -> None:
    for errs in ranks.run(check_module_conversions, ranks=2):
        assert all(e <= 1e-12 for e in errs), errs


def check_no_expert_ids(group: dist.ProcessGroup) -> dict[str, float]:
    """-1 in topk_ids (no expert) through the expert-parallel layer equals the single-process layer,
    forward and every gradient; a -1 pair's weight (NaN here) is ignored."""
    ref, layer, x_all, mine = build(group, 16, 2, "skewed", "softmax", 0)
    ids_all, w_all = ref.route(x_all)
    g = torch.Generator().manual_seed(5)
    none = torch.rand(ids_all.shape, generator=g) < 0.3
    ids_all, w_all = ids_all.masked_fill(none, -1), w_all.masked_fill(none, float("nan")).requires_grad_()
    x_ref = x_all.clone().requires_grad_()
    out_ref = ref.routed_experts(x_ref, ids_all, w_all)
    go = torch.randn(out_ref.shape, generator=g)
    grads_ref = torch.autograd.grad((out_ref * go).sum(), [x_ref, w_all, ref.w_down])
    x = x_all[mine].clone().requires_grad_()
    w = w_all.detach()[mine].clone().requires_grad_()
    out = layer.routed_experts(x, ids_all[mine], w)
    grads = torch.autograd.grad((out * go[mine]).sum(), [x, w, layer.w_down])
    home = layer.home_experts()
    assert torch.isfinite(out).all() and not grads[1][none[mine]].any()
    return {"out": rel(out, out_ref[mine]), "x": rel(grads[0], grads_ref[0][mine]),
            "w": rel(grads[1], grads_ref[1][mine]), "w_down": rel(grads[2], grads_ref[2][home.start:home.stop])}


@pytest.mark.timeout(60)
def test_no_expert_ids_match_reference(ranks: RankPool) -> None:
    for errs in ranks.run(check_no_expert_ids, ranks=2):
        assert all(e <= 1e-5 for e in errs.values()), errs


def check_bad_layer_input(group: dist.ProcessGroup, kind: str) -> tuple[str, str, float]:
    """Rank 1 feeds the layer a bad x; every rank raises within 1 s, then a good step works."""
    ref, layer, x_all, mine = build(group, 16, 2, "uniform", "softmax", 1)
    x = x_all[mine].clone()
    if dist.get_rank(group) == 1:
        if kind == "width":
            x = torch.randn(x.shape[0], H + 3)
        elif kind == "dtype":
            x = x.double()
        elif kind == "nan":
            x[2, 5] = float("nan")
    start = time.perf_counter()
    try:
        layer(x)
        outcome = ("none", "")
    except (ValueError, RemoteInputError) as e:
        outcome = (type(e).__name__, str(e))
    elapsed = time.perf_counter() - start
    assert rel(layer(x_all[mine]), ref(x_all)[mine]) <= 1e-5  # the group still works
    return (*outcome, elapsed)


@pytest.mark.parametrize("kind", ["width", "dtype", "nan"])
@pytest.mark.timeout(60)
def test_bad_layer_input_raises_on_every_rank(ranks: RankPool, kind: str) -> None:
    good, bad = ranks.run(check_bad_layer_input, kind, ranks=2)
    assert good[0] == "RemoteInputError" and "rank 1 rejected its input" in good[1], good
    assert bad[0] == "ValueError" and "rank 1" in bad[1], bad
    expected = {"width": r"x must be \[\.\.\., 16\] torch.float32 on cpu, got \[\d+, 19\]",
                "dtype": r"x must be \[\.\.\., 16\] torch.float32 on cpu, got \[\d+, 16\] torch.float64",
                "nan": "x holds 1 non-finite values"}[kind]
    assert re.search(expected, bad[1]), bad
    assert good[2] < 1.0 and bad[2] < 1.0
