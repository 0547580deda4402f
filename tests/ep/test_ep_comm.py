"""EPBuffer on real gloo groups (2, 3, 4 and 8 ranks) against the single-process reference, bit for bit."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from rank_pool import RankPool

from k3sys.ep import make_routing
from k3sys.ep.comm import EPBuffer, RemoteInputError
from k3sys.ep.comm_reference import (
    combine_reference,
    dispatch_reference,
    prefetch_reference,
    reduce_grads_reference,
)
from k3sys.ep.homes import Homes
from k3sys.ep.measure import hot_on_rank0

H = 16
WEIGHT_SHAPES = {"w_in": (H, 24), "w_out": (24, H)}


def make_inputs(R: int, E: int, K: int, S: int, maxvio: float, hot_rank0: bool, step: int = 0):
    """Every rank's (x [s_r, H], topk_ids [s_r, K], topk_weights [s_r, K]), uneven s_r <= S, same on every rank."""
    ids = make_routing(R, S, E, K, maxvio, seed=7, step=step)
    if hot_rank0:
        ids = hot_on_rank0(ids, E)
    g = torch.Generator().manual_seed(100 + step)
    sizes = [S - (r * 7 + step) % (S // 2) for r in range(R)]
    xs = [torch.randn(s, H, generator=g) for s in sizes]
    ws = [torch.rand(s, K, generator=g) for s in sizes]
    return xs, [ids[r, :s] for r, s in enumerate(sizes)], ws


class _Scaled(torch.autograd.Function):
    """w * scale, recording where its (freshly allocated) gradient lives."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: torch.Tensor, made: dict, name: str) -> torch.Tensor:
        ctx.scale, ctx.made, ctx.name = scale, made, name
        return w * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad * ctx.scale
        ctx.made[ctx.name] = out.data_ptr()
        return out, None, None, None


class _SameGrad(torch.autograd.Function):
    """a + b whose backward hands the very same gradient tensor to both inputs."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


def per_rank(R: int, seed: int, make) -> list:
    g = torch.Generator().manual_seed(seed)
    return [make(g) for _ in range(R)]


def check_paths(group: dist.ProcessGroup, E: int, K: int, S: int, maxvio: float, hot_rank0: bool, padding: int):
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    homes = Homes(E, R)  # uneven when R does not divide E: home weights have homes.count(r) rows
    epn = homes.epn
    xs, ids, ws = make_inputs(R, E, K, S, maxvio, hot_rank0)
    buf = EPBuffer(group, S, H, K, E, token_padding=padding)
    x = xs[rank].clone().requires_grad_()
    recv_x, recv_w, cu, h = buf.dispatch(x, ids[rank], ws[rank])
    p = h.plan
    ref_x, ref_w = dispatch_reference(p, xs, ids, ws)
    rows = h.recv_row_n
    assert rows.numel() == int(p.cap[rank]) == int(p.loads[rank])  # exactly its cap
    assert torch.equal(cu, p.cu_seqlens[rank]) and recv_x.shape == (buf.buffer_rows, H)
    assert torch.equal(recv_x[rows], ref_x[rank][rows])
    assert torch.equal(recv_w, ref_w[rank])

    outs = per_rank(R, 1, lambda g: torch.randn(buf.buffer_rows, H, generator=g))
    out = buf.combine(h, outs[rank])
    assert torch.equal(out, combine_reference(p, outs, ids, ws)[rank])

    g2 = torch.Generator().manual_seed(2)
    home_w = [{n: torch.randn(homes.count(r), *s, generator=g2) for n, s in WEIGHT_SHAPES.items()} for r in range(R)]
    home, replicas = buf.prefetch(h, home_w[rank])
    assert all(torch.equal(home[n], home_w[rank][n]) for n in WEIGHT_SHAPES)
    ref_rep = prefetch_reference(p, home_w)[rank]
    used = int((p.replicas[rank] >= 0).sum())
    assert (p.replicas[rank, used:] == -1).all()  # the planner fills slots from 0
    for n in WEIGHT_SHAPES:
        assert torch.equal(replicas[n], ref_rep[n][:used])
    grads = per_rank(R, 3, lambda g: {n: torch.randn(epn, *s, generator=g) for n, s in WEIGHT_SHAPES.items()})
    reduced = buf.reduce_grads(h, grads[rank])
    ref_red = reduce_grads_reference(p, grads)[rank]
    for n in WEIGHT_SHAPES:
        assert torch.equal(reduced[n], ref_red[n])

    # prefetch's backward: home gradient + the replicas' gradients, whether or not `home` is used, and
    # whether or not its gradient is shared with another tensor (which must then stay untouched).
    scale = {n: torch.randn(homes.count(rank), *s, generator=torch.Generator().manual_seed(6 + rank))
             for n, s in WEIGHT_SHAPES.items()}
    for use_home in ("no", "yes", "shared"):
        leaves = {n: w.clone().requires_grad_() for n, w in home_w[rank].items()}
        other = {n: torch.zeros_like(w, requires_grad=True) for n, w in home_w[rank].items()}
        home_v, rep_v = buf.prefetch(h, leaves)
        loss = sum((rep_v[n] * grads[rank][n][:used]).sum() for n in WEIGHT_SHAPES)
        made: dict[str, int] = {}
        for n in WEIGHT_SHAPES if use_home != "no" else ():
            w = home_v[n] if use_home == "yes" else _SameGrad.apply(home_v[n], other[n])
            loss = loss + _Scaled.apply(w, scale[n], made, n).sum()
        inputs = list(leaves.values()) + (list(other.values()) if use_home == "shared" else [])
        got = torch.autograd.grad(loss, inputs, materialize_grads=True)  # None = no copies here
        for n, g in zip(WEIGHT_SHAPES, got[: len(leaves)], strict=True):
            torch.testing.assert_close(g, ref_red[n] + scale[n] if use_home != "no" else ref_red[n],
                                       rtol=0, atol=1e-6)
            if use_home == "yes":
                assert g.data_ptr() == made[n]  # the replica rows were added into the home gradient in place
        for n, g in zip(WEIGHT_SHAPES, got[len(leaves):], strict=False):  # "shared" only
            assert torch.equal(g, scale[n])

    # Backward of dispatch and of combine against autograd through the reference.
    gy = per_rank(R, 4, lambda g: torch.randn(buf.buffer_rows, H, generator=g))
    (gx,) = torch.autograd.grad((recv_x * gy[rank]).sum(), x)
    xs_ref = [t.clone().requires_grad_() for t in xs]
    ref_x, _ = dispatch_reference(p, xs_ref, ids, ws)
    (gx_ref,) = torch.autograd.grad(sum((a * b).sum() for a, b in zip(ref_x, gy, strict=True)), xs_ref[rank])
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-6)
    eo = outs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    _, _, _, h2 = buf.dispatch(xs[rank], ids[rank], w)
    go = per_rank(R, 5, lambda g: [torch.randn(x.shape, generator=g) for x in xs])[0]
    geo, gw = torch.autograd.grad((buf.combine(h2, eo) * go[rank]).sum(), [eo, w])
    outs_ref = [t.clone().requires_grad_() for t in outs]
    ws_ref = [t.clone().requires_grad_() for t in ws]
    ref = combine_reference(p, outs_ref, ids, ws_ref)
    geo_ref, gw_ref = torch.autograd.grad(sum((a * b).sum() for a, b in zip(ref, go, strict=True)),
                                          [outs_ref[rank], ws_ref[rank]])
    torch.testing.assert_close(geo[rows], geo_ref[rows], rtol=1e-6, atol=1e-6)
    assert not geo[torch.ones(buf.buffer_rows, dtype=torch.bool).index_fill_(0, rows, False)].any()
    torch.testing.assert_close(gw, gw_ref, rtol=1e-6, atol=1e-6)
    homes_of_copies = homes.rank_of(p.replicas[p.replicas >= 0])
    most_copies_of_one_home = int(torch.bincount(homes_of_copies).max()) if homes_of_copies.numel() else 0
    return p.num_copies, most_copies_of_one_home / epn


CASES = [
    # (ranks, E, K, S, maxvio, hot on rank 0, token_padding)
    (2, 16, 2, 48, 0.0, False, 1),
    (2, 16, 2, 48, 3.0, True, 8),
    (4, 32, 2, 40, 10.0, False, 1),
    (4, 32, 4, 40, 5.0, True, 4),
    (4, 8, 2, 40, 2.5, True, 1),  # rank 0's experts have more copies than its epn=2 staging slots
    (3, 16, 2, 40, 3.0, True, 1),  # uneven homes: 5, 5 and 6 experts
    (3, 16, 4, 40, 1.0, False, 4),
]


def case_id(c: tuple) -> str:
    return f"R{c[0]}-E{c[1]}-K{c[2]}-vio{c[4]:g}-{'hot0' if c[5] else 'spread'}-pad{c[6]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.timeout(180)
def test_paths_match_reference(ranks: RankPool, case: tuple) -> None:
    R, *cfg = case
    results = ranks.run(check_paths, *cfg, ranks=R)
    copies, home_copies_per_slot = results[0]
    assert all(r == results[0] for r in results)  # every rank planned the same
    assert copies > 0 or case[4] == 0  # skewed routings exercised the replicas
    if case[1] == 8:
        assert home_copies_per_slot > 1  # reduce_grads needed more than one round


@pytest.mark.timeout(600)
def test_paths_match_reference_on_8_ranks_with_uneven_homes() -> None:
    """R=8, E=28: homes of 3 and 4 experts alternating (K3's 896 on 256 ranks in small), on a pool of
    its own (8 processes with tiny tensors)."""
    pool = RankPool(8, timeout=300)
    try:
        for case in ((28, 2, 24, 3.0, True, 1), (28, 4, 24, 0.5, False, 2)):
            results = pool.run(check_paths, *case)
            assert all(r == results[0] for r in results)  # every rank planned the same
            assert results[0][0] > 0  # replicas exercised
    finally:
        pool.close()


def check_static_storage(group: dist.ProcessGroup, steps: int) -> bool:
    """20 steps with different routings reuse the same receive storage."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, K, S = 32, 2, 40
    buf = EPBuffer(group, S, H, K, E)
    home = {n: torch.randn(E // R, *s, requires_grad=True) for n, s in WEIGHT_SHAPES.items()}
    seen = set()
    for step in range(steps):
        xs, ids, ws = make_inputs(R, E, K, S, maxvio=[0.0, 3.0, 12.0][step % 3], hot_rank0=step % 2 == 1, step=step)
        x = xs[rank].requires_grad_()
        recv_x, recv_w, _, h = buf.dispatch(x, ids[rank], ws[rank])
        _, rep = buf.prefetch(h, home)
        out = buf.combine(h, recv_x * 2 + rep["w_in"].sum())
        out.sum().backward()
        ptrs = (recv_x.data_ptr(), recv_w.data_ptr(), *(t.untyped_storage().data_ptr() for t in rep.values()),
                buf._src_nh.data_ptr(), buf._dst_nh.data_ptr())
        seen.add(ptrs)
        assert recv_x.shape == (buf.buffer_rows, H)
    return len(seen)


@pytest.mark.timeout(180)
def test_receive_storage_is_static(ranks: RankPool) -> None:
    assert ranks.run(check_static_storage, 20) == [1] * 4


def check_bad_input(group: dist.ProcessGroup, bad_rank: int, kind: str) -> tuple[str, str]:
    """`bad_rank` passes a bad input; every rank must raise (nobody hangs), then the group still works."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, K, S = 16, 2, 32
    buf = EPBuffer(group, S, H, K, E)
    xs, ids, ws = make_inputs(R, E, K, S, 0.0, False)
    x, i, w = xs[rank], ids[rank].clone(), ws[rank]
    if rank == bad_rank:
        if kind == "capacity":
            x, i, w = torch.randn(S + 1, H), torch.zeros(S + 1, K, dtype=torch.long), torch.rand(S + 1, K)
            i[:, 1] = 1
        elif kind == "ids-range":
            i[3, 0] = E
        elif kind == "ids-repeat":
            i[2, 1] = i[2, 0]
        elif kind == "weights-shape":
            w = w[:, :1]
        elif kind == "weights-device":
            w = torch.empty(w.shape, device="meta")  # any device but the buffer's
        elif kind == "ids-below-none":
            i[4, 1] = -2
        elif kind == "x-hidden":
            x = torch.randn(x.shape[0], H + 1)
        elif kind == "x-nan":
            x = x.clone()
            x[5, 3] = float("nan")
        elif kind == "x-inf":
            x = x.clone()
            x[0, 0] = -float("inf")
        elif kind == "weights-nan":
            w = w.clone()
            w[1, 1] = float("nan")
    start = time.perf_counter()
    try:
        buf.dispatch(x, i, w)
        outcome = ("none", "")
    except (ValueError, RemoteInputError) as e:
        outcome = (type(e).__name__, str(e))
    assert time.perf_counter() - start < 1.0  # every rank stops at once, none waits for a timeout
    # The failed step left no collective behind: a good step right after works on every rank.
    _, _, _, h = buf.dispatch(xs[rank], ids[rank], ws[rank])
    assert buf.combine(h, torch.zeros(buf.buffer_rows, H)).shape == (xs[rank].shape[0], H)
    return outcome


BAD = {
    "capacity": "x has s=33 tokens, more than the buffer capacity S=32",
    "ids-range": r"topk_ids must lie in \[-1, 16\) \(-1: no expert\), got \[0, 16\]",
    "ids-below-none": r"topk_ids must lie in \[-1, 16\) \(-1: no expert\), got \[-2, \d+\]",
    "ids-repeat": "topk_ids repeats an expert within a token's row",
    "weights-shape": r"topk_weights must be a float \[s=\d+, K=2\] tensor on cpu, got \[\d+, 1\]",
    "weights-device": r"topk_weights must be .* on cpu, got \[\d+, 2\] torch.float32 on meta",
    "x-hidden": r"x must be \[s, 16\] torch.float32 on cpu, got \[\d+, 17\]",
    "x-nan": r"x holds 1 non-finite values \(NaN or inf\)",
    "x-inf": r"x holds 1 non-finite values \(NaN or inf\)",
    "weights-nan": r"topk_weights holds 1 non-finite values \(NaN or inf\) on routed pairs",
}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.timeout(120)
def test_bad_dispatch_input_raises_everywhere(ranks: RankPool, kind: str) -> None:
    bad = 1 if kind in ("capacity", "ids-repeat", "x-hidden", "x-inf") else 0
    outcomes = ranks.run(check_bad_input, bad, kind, ranks=2)
    name, msg = outcomes[bad]
    assert name == "ValueError" and f"rank {bad}" in msg
    assert re.search(BAD[kind], msg), msg
    other = outcomes[1 - bad]
    assert other[0] == "RemoteInputError" and f"rank {bad} rejected its input" in other[1]


def check_bad_handle_and_shapes(group: dist.ProcessGroup) -> list[str]:
    """Errors every rank makes alike (SPMD code) raise locally, before any collective."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, K, S = 16, 2, 32
    buf, other = EPBuffer(group, S, H, K, E), EPBuffer(group, S, H, K, E)
    xs, ids, ws = make_inputs(R, E, K, S, 0.0, False)
    _, _, _, h = buf.dispatch(xs[rank], ids[rank], ws[rank])
    errors = []
    home = {n: torch.randn(E // R, *s) for n, s in WEIGHT_SHAPES.items()}
    for call in (
        lambda: other.combine(h, torch.zeros(other.buffer_rows, H)),
        lambda: buf.combine(h, torch.zeros(buf.buffer_rows - 1, H)),
        lambda: other.prefetch(h, home),
        lambda: buf.prefetch(h, {"w_in": torch.randn(E // R + 1, H, 24)}),
        lambda: buf.reduce_grads(h, home),
    ):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    buf.prefetch(h, home)
    for call in (lambda: buf.prefetch(h, {"w_in": home["w_in"]}), lambda: buf.reduce_grads(h, {"w_in": home["w_in"]})):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    return errors


@pytest.mark.timeout(120)
def test_bad_handle_and_shapes_raise(ranks: RankPool) -> None:
    errors = ranks.run(check_bad_handle_and_shapes, ranks=2)[0]
    assert "handle comes from another EPBuffer" in errors[0]
    assert "expert_out must be [" in errors[1]
    assert "handle comes from another EPBuffer" in errors[2]
    assert "home_weights['w_in'] must be [8, ...] (this rank's home experts), got [9, 16, 24]" in errors[3]
    assert "grads given before any prefetch" in errors[4]
    assert errors[5].startswith("home_weights must match the first prefetch's weights")
    assert errors[6].startswith("grads must match the first prefetch's weights")


def check_constructor_errors(group: dist.ProcessGroup) -> list[str]:
    errors = []
    for kwargs in ({"num_experts": 3}, {"capacity": 0}, {"top_k": 17}):
        args = {"capacity": 8, "hidden": H, "top_k": 2, "num_experts": 16} | kwargs
        with pytest.raises(ValueError) as info:
            EPBuffer(group, **args)
        errors.append(str(info.value))
    return errors


@pytest.mark.timeout(60)
def test_constructor_checks_parallel_sizes(ranks: RankPool) -> None:
    errors = ranks.run(check_constructor_errors)[0]
    assert errors == [
        "num_experts (3) must be >= the group size R (4)",
        "capacity must be >= 1, got 0",
        "top_k (17) must be <= num_experts (16)",
    ]


def check_no_expert_ids(group: dist.ProcessGroup, async_op: bool) -> list[float]:
    """-1 ids route nowhere and weigh nothing (even NaN weights there), in forward and backward.

    Experts that multiply by 3 make the expected output exact without any reference layer:
    `out[t] = 3 * x[t] * sum of t's weights over ids != -1`. Sync and async dispatch alike.
    """
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, K, S = 16, 3, 40
    buf = EPBuffer(group, S, H, K, E)
    xs, ids, ws = make_inputs(R, E, K, S, 3.0, True)
    x, i, w = xs[rank].clone().requires_grad_(), ids[rank].clone(), ws[rank].clone()
    none = torch.rand(i.shape, generator=torch.Generator().manual_seed(rank)) < 0.4
    none[0] = True  # a token with no expert at all
    i[none] = -1
    w[none] = float("nan")
    w.requires_grad_()
    if async_op:
        pending = buf.dispatch(x, i, w, async_op=True)
        torch.randn(64, 64) @ torch.randn(64, 64)  # work while the rows travel
        recv_x, _, _, h = pending.wait()
    else:
        recv_x, _, _, h = buf.dispatch(x, i, w)
    assert int(h.plan.tpe[rank].sum()) == int((~none).sum()) == h.send_pair_n.numel()
    out = buf.combine(h, recv_x * 3)
    kept = w.detach().masked_fill(none, 0).sum(1, keepdim=True)
    g = torch.randn(out.shape)
    gx, gw = torch.autograd.grad((out * g).sum(), [x, w])
    assert not out[0].any() and gw[none].eq(0).all()
    return [rel(out, 3 * x.detach() * kept), rel(gx, 3 * g * kept),
            rel(gw[~none], (3 * x.detach() * g).sum(1, keepdim=True).expand_as(gw)[~none])]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.timeout(60)
def test_no_expert_ids_contribute_nothing(ranks: RankPool, async_op: bool) -> None:
    for errs in ranks.run(check_no_expert_ids, async_op, ranks=2):
        assert all(e <= 1e-6 for e in errs), errs  # also fails on NaN


def check_async_dispatch(group: dist.ProcessGroup) -> bool:
    """An async dispatch, waited after other work, lands the same rows as a synchronous one."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, K, S = 32, 2, 40
    buf = EPBuffer(group, S, H, K, E)
    xs, ids, ws = make_inputs(R, E, K, S, 5.0, True)
    recv_sync, w_sync, cu_sync, _ = buf.dispatch(xs[rank], ids[rank], ws[rank])
    recv_sync, w_sync = recv_sync.clone(), w_sync.clone()
    pending = buf.dispatch(xs[rank], ids[rank], ws[rank], async_op=True)
    torch.randn(128, 128) @ torch.randn(128, 128)
    recv_x, recv_w, cu, h = pending.wait()
    assert pending.wait()[0] is recv_x  # wait() twice is harmless
    rows = h.recv_row_n
    return torch.equal(recv_x[rows], recv_sync[rows]) and torch.equal(recv_w, w_sync) and torch.equal(cu, cu_sync)


@pytest.mark.timeout(60)
def test_async_dispatch_equals_sync(ranks: RankPool) -> None:
    assert ranks.run(check_async_dispatch) == [True] * 4


def check_failure_after_dispatch(group: dist.ProcessGroup) -> tuple[str, str]:
    """A bare buffer's user whose expert code raises on rank 1 between dispatch and combine: rank 1
    finishes its part (`abandon`) and reports at the check-in the others reach after combine; every
    rank raises, then a normal step works."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    E, K, S = 16, 2, 32
    buf = EPBuffer(group, S, H, K, E)
    xs, ids, ws = make_inputs(R, E, K, S, 3.0, True)
    home = {n: torch.randn(buf.homes.count(rank), *s) for n, s in WEIGHT_SHAPES.items()}
    recv_x, _, _, h = buf.dispatch(xs[rank], ids[rank], ws[rank])
    buf.prefetch(h, home)
    try:
        if rank == 1:
            raise RuntimeError("expert failure")
        buf.combine(h, recv_x * 2)
        buf.check_in()
        outcome = ("none", "")
    except RuntimeError as e:
        outcome = (type(e).__name__, str(e))
        if rank == 1:
            buf.abandon(h, None)  # prefetch ran: only combine's transfer is left
            with pytest.raises(ValueError, match="rank 1: RuntimeError: expert failure"):
                buf.check_in(f"{type(e).__name__}: {e}")
    _, _, _, h = buf.dispatch(xs[rank], ids[rank], ws[rank])
    assert buf.combine(h, torch.zeros(buf.buffer_rows, H)).shape == (xs[rank].shape[0], H)
    return outcome


@pytest.mark.timeout(120)
def test_failure_between_dispatch_and_combine_raises_everywhere(ranks: RankPool) -> None:
    outcomes = ranks.run(check_failure_after_dispatch, ranks=3)
    assert outcomes[1] == ("RuntimeError", "expert failure")
    for name, message in (outcomes[0], outcomes[2]):
        assert name == "RemoteStepError" and "rank 1 failed: RuntimeError: expert failure" in message, message
