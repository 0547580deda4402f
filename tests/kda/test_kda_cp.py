"""kda_chunk_cp on real gloo ranks (2, 3, 4) against the single-process kda_chunk: outputs, final
states and every input gradient, for even and uneven splits and sequences crossing rank boundaries."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ep"))  # the project's real-gloo harness
from kda_inputs import make_inputs, make_raw_inputs, rel_rms  # noqa: E402
from rank_pool import RankError, RankPool  # noqa: E402

from k3sys.kda import KimiDeltaAttention, kda_chunk, kda_chunk_cp  # noqa: E402
from k3sys.kda.cp import slice_layout  # noqa: E402
from k3sys.model import HybridModel, ModelConfig  # noqa: E402

_SUBGROUPS: dict[int, dist.ProcessGroup] = {}


def _group(world: dist.ProcessGroup, size: int) -> dist.ProcessGroup | None:
    """The first `size` ranks of the pool's world (created once per worker; every rank takes part)."""
    if size == dist.get_world_size(world):
        return world
    if size not in _SUBGROUPS:
        _SUBGROUPS[size] = dist.new_group(list(range(size)))
    return _SUBGROUPS[size] if dist.get_rank(world) < size else None


def _loss_weights(o: torch.Tensor, S: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=gen, dtype=torch.float64),
            torch.randn(S.shape, generator=gen, dtype=torch.float64))


def _check_rank(world: dist.ProcessGroup, sizes: list[int], B: int, H: int, K: int, V: int, cu: list[int] | None,
                dtype: torch.dtype, chunk_size: int, backend: str = "torch", option_set: str | None = None,
                HV: int | None = None) -> dict[str, float] | None:
    """Run the CP op on this rank's slice and the single-process op on the whole; relative errors of this rank.

    option_set: a `kda_inputs.OPTION_SETS` name: raw inputs and the op's options (fla's), HV value heads."""
    group = _group(world, len(sizes))
    if group is None:
        return None
    if backend == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when k3sys.kda.triton is first imported
    rank, T = dist.get_rank(group), sum(sizes)
    start, end = sum(sizes[:rank]), sum(sizes[:rank + 1])
    HV = HV or H
    inputs, opts = (make_inputs(B, T, H, K, V, dtype=dtype, seed=3), {}) if option_set is None else (
        make_raw_inputs(B, T, H, HV, K, V, option_set, dtype=dtype, seed=3))
    N = B if cu is None else len(cu) - 1
    state_shape = (N, HV, *((V, K) if opts.get("state_v_first") else (K, V)))
    h0 = torch.randn(state_shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(
        torch.promote_types(dtype, torch.float32))
    cu_t = None if cu is None else torch.tensor(cu)
    ref_in = [x.clone().requires_grad_() for x in (*inputs, h0)]
    o_ref, S_ref = kda_chunk(*ref_in[:5], initial_state=ref_in[5], output_final_state=True, cu_seqlens=cu_t,
                             chunk_size=chunk_size, backend=backend, **opts)
    w_o, w_s = _loss_weights(o_ref, S_ref, seed=5)
    ((o_ref.double() * w_o).sum() + (S_ref.double() * w_s).sum()).backward()

    cp_in = [x[:, start:end].clone().requires_grad_() for x in inputs] + [h0.clone().requires_grad_()]
    o, S = kda_chunk_cp(*cp_in[:5], group=group, initial_state=cp_in[5], output_final_state=True, cu_seqlens=cu_t,
                        chunk_size=chunk_size, backend=backend, **opts)
    # the local pieces: sequences [first, first + N_r), the last of which may carry on to the next rank
    first = 0 if cu is None else [n for n in range(N) if cu[n] <= start < cu[n + 1]][0]
    ends_here = [n for n in range(first, first + S.shape[0]) if (end == T if cu is None else cu[n + 1] <= end)]
    loss = (o.double() * w_o[:, start:end]).sum() + (S[[n - first for n in ends_here]].double() * w_s[ends_here]).sum()
    loss.backward()
    # the state at the end of this rank's slice, of a sequence that carries on: the op over the prefix
    prefix_cu = None if cu is None else torch.tensor([c for c in cu if c < end] + [end])
    _, S_prefix = kda_chunk(*(x[:, :end] for x in inputs), initial_state=h0[:len(prefix_cu) - 1 if cu else N],
                            output_final_state=True, cu_seqlens=prefix_cu, chunk_size=chunk_size, backend="torch",
                            **opts)
    dh0 = torch.zeros_like(h0) if cp_in[5].grad is None else cp_in[5].grad.clone()  # None: no row read here
    dist.all_reduce(dh0, group=group)  # each rank holds the gradient of the rows it read
    errors = {"o": rel_rms(o, o_ref[:, start:end].detach()),
              "state": rel_rms(S, S_prefix[S_prefix.shape[0] - S.shape[0]:]),
              "initial_state": rel_rms(dh0, ref_in[5].grad)}
    for name, x, r in zip(["q", "k", "v", "g", "beta"], cp_in, ref_in, strict=False):
        errors["d" + name] = rel_rms(x.grad, r.grad[:, start:end])
    return errors


CASES = {
    # name: (sizes per rank, B, cu_seqlens or None)
    "2 ranks even, B=2": ([48, 48], 2, None),
    "3 ranks uneven": ([37, 20, 43], 1, None),
    "4 ranks uneven, a 7-token slice": ([16, 33, 7, 40], 1, None),
    "sequence boundary at the rank boundary": ([25, 35, 30], 1, [0, 25, 60, 90]),
    "varlen, one sequence over 3 ranks": ([20, 20, 20, 30], 1, [0, 5, 50, 66, 90]),
    "varlen, short sequences inside slices": ([23, 41], 1, [0, 3, 9, 30, 33, 64]),
}


@pytest.fixture(scope="module")
def pool():
    p = RankPool(4, timeout=60)
    yield p
    p.close()


@pytest.mark.parametrize("name", list(CASES))
def test_cp_fp64_is_exact(pool: RankPool, name: str) -> None:
    sizes, B, cu = CASES[name]
    results = pool.run(_check_rank, sizes, B, 2, 16, 12, cu, torch.float64, 16)
    for rank, errors in enumerate(results[:len(sizes)]):
        for what, err in errors.items():
            assert err < 1e-12, f"{name}: rank {rank} {what} relative error {err:.3g}"


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_cp_low_precision_matches_single_process(pool: RankPool, dtype: torch.dtype, tol: float) -> None:
    """fp32: within fp32 round-off of the single-process op; bf16: within bf16 rounding of its outputs."""
    results = pool.run(_check_rank, [30, 34, 17], 1, 2, 16, 16, [0, 10, 70, 81], dtype, 16)
    for rank, errors in enumerate(results[:3]):
        for what, err in errors.items():
            assert err < tol, f"{dtype}: rank {rank} {what} relative error {err:.3g}"


def test_cp_wide_heads_and_larger_chunks(pool: RankPool) -> None:
    """V + K > 512 (the transition then takes its own call) and chunk_size 32."""
    results = pool.run(_check_rank, [40, 29], 1, 1, 260, 260, None, torch.float64, 32, ranks=2)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 1e-12, f"rank {rank}: {errors}"


def test_cp_inherits_the_triton_backend(pool: RankPool) -> None:
    """backend="triton" (Triton's interpreter on CPU): every kda_chunk call of the CP op runs the kernels."""
    pytest.importorskip("triton", reason="triton is not installed")
    results = pool.run(_check_rank, [23, 26], 1, 1, 16, 16, [0, 9, 49], torch.float32, 16, "triton", ranks=2)
    for rank, errors in enumerate(results):
        assert max(errors.values()) < 2e-6, f"rank {rank}: {errors}"


@pytest.mark.parametrize("option_set", ["all_v_first", "neg_eigval", "softplus_gate"])
def test_cp_takes_the_ops_options_and_gva(pool: RankPool, option_set: str) -> None:
    """fla's options (in-op L2 norm, gate, sigmoid beta, x2 beta, [V, K] states) and 2 value heads per q/k
    head, sequences crossing rank boundaries: exact in fp64, outputs, states and every gradient."""
    results = pool.run(_check_rank, [30, 21, 29], 1, 1, 16, 12, [0, 10, 55, 80], torch.float64, 16, "torch",
                       option_set, 2)
    for rank, errors in enumerate(results[:3]):
        assert max(errors.values()) < 1e-12, f"{option_set}: rank {rank}: {errors}"


def _bad_cu(world: dist.ProcessGroup) -> None:
    x = torch.zeros(1, 8, 1, 4)
    kda_chunk_cp(x, x, x, x, x[..., 0], group=world, cu_seqlens=torch.tensor([0, 5, 15]))


def test_cp_rejects_cu_seqlens_of_the_wrong_total(pool: RankPool) -> None:
    with pytest.raises(RankError, match=r"total length 16 .* got \[0, 5, 15\]"):
        pool.run(_bad_cu, ranks=2)


def test_slice_layout() -> None:
    cu = [0, 5, 50, 66, 90]
    lay = slice_layout(cu, 0, 20, 0, 4)
    assert (lay.head, lay.local_cu, lay.first, lay.carries_out) == (0, [0, 5, 20], 0, True)
    lay = slice_layout(cu, 20, 40, 1, 4)  # inside sequence 1
    assert (lay.head, lay.local_cu, lay.first, lay.carries_out) == (20, [0, 20], 2, True)
    lay = slice_layout(cu, 40, 60, 2, 4)  # end of sequence 1, start of sequence 2
    assert (lay.head, lay.local_cu, lay.first, lay.carries_out) == (10, [0, 10, 20], 2, True)
    lay = slice_layout([0, 25, 60, 90], 25, 60, 1, 3)  # boundaries on both rank edges
    assert (lay.head, lay.local_cu, lay.first, lay.carries_out) == (0, [0, 35], 1, False)
    lay = slice_layout(None, 0, 7, 2, 4)
    assert (lay.head, lay.local_cu, lay.carries_out) == (7, None, True)


def _errors_under_cp(group: dist.ProcessGroup, sizes: list[int], module: torch.nn.Module, x: torch.Tensor,
                     w: torch.Tensor, call) -> tuple[dict[str, float], object, object]:
    """`call(x, cp_group)` -> (y, extra) on this rank's slice against one process over the whole x:
    relative errors of y and of every parameter gradient (summed over ranks), and both extras."""
    rank = dist.get_rank(group)
    start, end = sum(sizes[:rank]), sum(sizes[:rank + 1])
    y_ref, extra_ref = call(x, None)
    (y_ref * w).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    y, extra = call(x[:, start:end], group)
    (y * w[:, start:end]).sum().backward()
    errors = {"y": rel_rms(y, y_ref[:, start:end].detach())}
    for n, p in module.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank holds its slice's share
        if n in ref_grads:
            errors["d" + n] = rel_rms(grad, ref_grads[n])
    return errors, extra, extra_ref


def _layer_rank(world: dist.ProcessGroup, sizes: list[int]) -> dict[str, float] | None:
    """fla's layer (softplus gate, 2 value heads per q/k head, beta in (0, 2), [V, K] states) under CP
    against one process (fp64): y, the last rank's states, every parameter gradient."""
    group = _group(world, len(sizes))
    if group is None:
        return None
    torch.manual_seed(0)
    layer = KimiDeltaAttention.from_fla_config(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4,
                                               allow_neg_eigval=True).double()
    gen = torch.Generator().manual_seed(1)
    x, w = (torch.randn(2, sum(sizes), 32, generator=gen, dtype=torch.float64) for _ in range(2))
    errors, state, state_ref = _errors_under_cp(group, sizes, layer, x, w, lambda x, g: layer(x, cp_group=g))
    if dist.get_rank(group) == len(sizes) - 1:
        errors["S"] = rel_rms(state.recurrent, state_ref.recurrent.detach())
        errors["conv"] = rel_rms(state.conv, state_ref.conv.detach())
    return errors


def test_fla_layer_under_cp_equals_one_process(pool: RankPool) -> None:
    """The layer's CP path: conv halo, then kda_chunk_cp with the layer's in-op activations and GVA."""
    results = pool.run(_layer_rank, [20, 13, 30])
    for rank, errors in enumerate(results[:3]):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-10, f"rank {rank}: {worst} relative error {errors[worst]:.3g}"
    assert "S" in results[2] and "conv" in results[2]


def _model_rank(world: dist.ProcessGroup, sizes: list[int]) -> dict[str, float] | None:
    """The hybrid model's forward and parameter gradients under CP against one process (fp64, RoPE on)."""
    group = _group(world, len(sizes))
    if group is None:
        return None
    torch.manual_seed(0)
    model = HybridModel(ModelConfig.from_preset("tiny", mla_use_rope=True)).double()
    ids = torch.randint(0, model.cfg.vocab_size, (2, sum(sizes)), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, sum(sizes), model.cfg.vocab_size, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    return _errors_under_cp(group, sizes, model, ids, w, lambda ids, g: (model(ids, cp_group=g), None))[0]


@pytest.mark.parametrize("sizes", [[20, 13, 30], [16, 16, 3, 25]], ids=["3 ranks", "4 ranks, a 3-token slice"])
def test_model_prefill_under_cp_equals_one_process(pool: RankPool, sizes: list[int]) -> None:
    """KDA layers (conv halo + exact state passing), MLA layers (gathered latent KV, global positions), FFNs."""
    results = pool.run(_model_rank, sizes)
    for rank, errors in enumerate(results[:len(sizes)]):
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-10, f"rank {rank}: {worst} relative error {errors[worst]:.3g}"
        assert len(errors) > 20  # every parameter's gradient was compared
