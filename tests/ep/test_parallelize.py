"""`apply_ep` on the hybrid model (real gloo groups of 2 and 3 ranks) against the single-process model."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rank_pool import COLLECTIVE_TIMEOUT_S, RankPool

from k3sys.ep import ExpertParallelMoE, MoELayer, apply_ep, parallelize
from k3sys.ep.syncs import count_syncs
from k3sys.model import HybridModel, ModelConfig, generate

BATCH = [2, 1, 3]  # sequences per rank: uneven token counts
T, NEW = 8, 4
CAPACITY = max(BATCH) * T


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


def tiny_models(group: dist.ProcessGroup, async_dispatch: bool = True, experts: int = 6
                ) -> tuple[HybridModel, HybridModel]:
    """The tiny preset (latent MoE + shared expert, KDA and MLA) with E experts (default 6, a multiple
    of 2 and 3): the single-process reference and its expert-parallel copy."""
    torch.manual_seed(0)
    ref = HybridModel(ModelConfig.from_preset("tiny", num_experts=experts))
    return ref, apply_ep(copy.deepcopy(ref), group, CAPACITY, async_dispatch=async_dispatch)


def token_batches(R: int, vocab: int, length: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (BATCH[r], length), generator=g) for r in range(R)]


def check_training(group: dist.ProcessGroup, steps: int, async_dispatch: bool, num_experts: int = 6) -> list[float]:
    """Forward, backward and SGD steps: every rank's logits, and every parameter's total update, equal
    the single-process model's on all ranks' batches (non-expert gradients all-reduced as data
    parallelism would; expert gradients come out complete on their home rank)."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    ref, model = tiny_models(group, async_dispatch, num_experts)
    ep_layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    assert len(ep_layers) == 3 and not any(type(m) is MoELayer for m in model.modules())
    experts = {id(getattr(m, n)) for m in ep_layers for n in ("w_gate", "w_up", "w_down")}
    home = ep_layers[0].home_experts()
    # Uneven homes when R does not divide E: rank r holds [floor(rE/R), floor((r+1)E/R)).
    assert home == range(rank * num_experts // R, (rank + 1) * num_experts // R)
    assert all(m.w_gate.shape[0] == len(home) for m in ep_layers)

    def sliced(module: HybridModel) -> dict[str, torch.Tensor]:
        return {n: (p[home.start:home.stop] if n.endswith(("experts.w_gate", "experts.w_up", "experts.w_down"))
                    else p).detach().clone() for n, p in module.named_parameters()}

    batches = token_batches(R, ref.cfg.vocab_size, T + 1)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    start_ref, start = sliced(ref), {n: p.detach().clone() for n, p in model.named_parameters()}
    errs = []
    for _ in range(steps):
        opt_ref.zero_grad()
        logits_ref = [ref(b[:, :-1]) for b in batches]
        sum(F.cross_entropy(lg.flatten(0, 1), b[:, 1:].flatten(), reduction="sum")
            for lg, b in zip(logits_ref, batches, strict=True)).backward()
        opt_ref.step()
        opt.zero_grad()
        mine = batches[rank]
        logits = model(mine[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten(), reduction="sum").backward()
        for p in model.parameters():
            if id(p) not in experts:
                dist.all_reduce(p.grad, group=group)
        opt.step()
        errs.append(rel(logits, logits_ref[rank]))
    end_ref = sliced(ref)
    errs += [rel(p.detach() - start[n], end_ref[n] - start_ref[n]) for n, p in model.named_parameters()]
    return errs


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.timeout(300)
def test_hybrid_model_training_equals_single_process(ranks: RankPool, R: int) -> None:
    for errs in ranks.run(check_training, 3, True, ranks=R):
        assert all(e <= 2e-5 for e in errs), errs  # fp32 round-off (measured <= 4e-6); also fails on NaN


@pytest.mark.timeout(300)
def test_hybrid_model_with_uneven_homes_equals_single_process(ranks: RankPool) -> None:
    # E=16 on R=3: homes of 5, 5 and 6 experts (the short ranks' last home group is empty).
    per_rank = ranks.run(check_training, 3, True, 16, ranks=3)
    for errs in per_rank:
        assert all(e <= 2e-5 for e in errs), errs


@pytest.mark.timeout(300)
def test_synchronous_dispatch_gives_the_same_training(ranks: RankPool) -> None:
    for errs in ranks.run(check_training, 1, False, ranks=2):
        assert all(e <= 2e-5 for e in errs), errs


def check_generate(group: dist.ProcessGroup) -> bool:
    """Greedy generation under EP (prefill + decode on the cache, each rank its own prompts of its own
    length) gives the single-process model's tokens."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    ref, model = tiny_models(group)
    prompt = token_batches(R, ref.cfg.vocab_size, T - rank)[rank]
    return torch.equal(generate(model, prompt, NEW), generate(ref, prompt, NEW))


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.timeout(300)
def test_generate_under_ep(ranks: RankPool, R: int) -> None:
    assert ranks.run(check_generate, ranks=R) == [True] * R


def value_error(call: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def check_apply_ep_errors(group: dist.ProcessGroup) -> list[str]:
    return [value_error(lambda: apply_ep(torch.nn.Linear(4, 4), group, 8)),
            value_error(lambda: apply_ep(MoELayer(8, 8, 1, 1), group, 8)),
            value_error(lambda: apply_ep(apply_ep(MoELayer(8, 8, 4, 2), group, 8), group, 8)),
            value_error(lambda: apply_ep(MoELayer(8, 8, 4, 2), group, 8, token_padding=0))]


@pytest.mark.timeout(60)
def test_apply_ep_rejects_bad_models(ranks: RankPool) -> None:
    assert ranks.run(check_apply_ep_errors, ranks=2)[0] == [
        "apply_ep: Linear holds no MoELayer",
        "num_experts (1) must be >= the group size R (2)",
        "apply_ep: the model is already expert-parallel",
        "token_padding must be >= 1, got 0",
    ]


def _raise_injected(*_: object) -> None:
    raise RuntimeError("injected failure")


def check_model_failure(group: dist.ProcessGroup, where: str) -> tuple[str, str]:
    """Rank 1's model forward fails outside any MoE layer (bad token id in the embedding, before the
    first MoE layer; or an attention error between MoE layers 0 and 1): every rank raises, the other
    naming rank 1, and the next forward works on every rank."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    ref, model = tiny_models(group)
    ids = token_batches(R, ref.cfg.vocab_size, T)[rank]
    bad, hook = ids, None
    if rank == 1 and where == "embedding":
        bad = ids.clone()
        bad[0, 3] = ref.cfg.vocab_size + 5
    elif rank == 1:
        hook = model.blocks[2].attn.register_forward_pre_hook(_raise_injected)  # blocks 1-3 are MoE
    try:
        model(bad)
        outcome = ("none", "")
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        outcome = (type(e).__name__, str(e))
    if hook is not None:
        hook.remove()
    assert rel(model(ids), ref(ids)) <= 2e-5  # the group still works
    return outcome


@pytest.mark.parametrize("where", ["embedding", "between-layers"])
@pytest.mark.timeout(120)
def test_model_failure_outside_moe_layers_fails_every_rank(ranks: RankPool, where: str) -> None:
    other, bad = ranks.run(check_model_failure, where, ranks=2)
    error = "IndexError: index out of range" if where == "embedding" else "RuntimeError: injected failure"
    assert bad[0] == error.split(":")[0], bad
    assert other[0] == "RemoteStepError", other
    assert "rank 1 failed: HybridModel forward raised before MoE layer" in other[1] and error in other[1], other


def check_syncs(group: dist.ProcessGroup) -> tuple[dict[str, int], dict[str, int]]:
    """Host syncs made by the expert-parallel code (`k3sys.ep`) in one training forward and in its
    backward, of the hybrid model (KDA's own syncs are not counted here)."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    _, model = tiny_models(group)
    batch = token_batches(R, model.cfg.vocab_size, T + 1)[rank]
    with count_syncs(within="k3sys.ep") as forward:
        logits = model(batch[:, :-1])
    with count_syncs(within="k3sys.ep") as backward:
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    return dict(forward), dict(backward)


@pytest.mark.timeout(300)
def test_moe_step_syncs_only_for_split_sizes(ranks: RankPool) -> None:
    # Per MoE layer one read (the all_to_all split sizes, with the verdicts, the group ends and the
    # replica table in the same copy), none in backward; per forward one more (the check-in that
    # fails every rank fast, see test_failure_between_dispatch_and_combine_fails_every_rank).
    for forward, backward in ranks.run(check_syncs, ranks=3):
        assert forward == {"tolist": 3 + 1}, forward  # 3 MoE layers + the check-in
        assert backward == {}, backward


class _RaiseOnCall:
    """Stands in for the expert function: raises on its `n`-th call, runs the real one otherwise."""

    def __init__(self, real: Callable[..., torch.Tensor], n: int) -> None:
        self.real, self.n, self.calls = real, n, 0

    def __call__(self, *args: object) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected expert failure")
        return self.real(*args)


def check_failure_inside_moe_layer(group: dist.ProcessGroup, where: str) -> tuple[str, str, list[str], float]:
    """Rank 1 fails between a MoE layer's dispatch and its combine (its expert function raises in the
    first or the last MoE layer, or the second layer's shared expert raises while the tokens travel):
    every rank raises, the others naming rank 1 and its error, and the next forward works."""
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    ref, model = tiny_models(group)
    ids = token_batches(R, ref.cfg.vocab_size, T)[rank]
    real, hook = parallelize.grouped_swiglu, None
    if rank == 1 and where.startswith("experts"):
        parallelize.grouped_swiglu = _RaiseOnCall(real, 1 if where == "experts-first" else 3)
    elif rank == 1:
        hook = model.blocks[2].ffn.shared.register_forward_pre_hook(_raise_injected)  # blocks 1-3 are MoE
    start = time.perf_counter()
    try:
        model(ids)
        outcome = ("none", "", [])
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        outcome = (type(e).__name__, str(e), getattr(e, "__notes__", []))
    finally:
        parallelize.grouped_swiglu = real
        if hook is not None:
            hook.remove()
    elapsed = time.perf_counter() - start
    assert rel(model(ids), ref(ids)) <= 2e-5  # the group still works
    return (*outcome, elapsed)


@pytest.mark.parametrize("where", ["experts-first", "experts-last", "shared-expert"])
@pytest.mark.timeout(180)
def test_failure_between_dispatch_and_combine_fails_every_rank(ranks: RankPool, where: str) -> None:
    results = ranks.run(check_failure_inside_moe_layer, where, ranks=3)
    error = "RuntimeError: injected" + (" expert failure" if where.startswith("experts") else " failure")
    name, message, notes, _ = results[1]
    assert name == "RuntimeError" and error.endswith(message), results[1]
    assert any("rank 1" in note for note in notes), notes
    for name, message, _, elapsed in (results[0], results[2]):
        assert name == "RemoteStepError" and "rank 1 failed" in message and error in message, (name, message)
        assert elapsed < COLLECTIVE_TIMEOUT_S  # told by rank 1, not by gloo's timeout
