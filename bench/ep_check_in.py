"""Claim: the check-in every model forward under `apply_ep` ends with (issue 29: a rank whose forward
fails after its last agreement point tells the others before any of them starts the backward) costs a
small fraction of the forward.

R gloo ranks (mp.spawn, one thread each) run the tiny hybrid model (3 MoE layers of 4, E=6) under
`apply_ep`, each rank 2 x 32 tokens. Per step, in the same processes: one forward (which ends with
the check-in) and, right after, `EPBuffer.check_in()` alone (the same all-gather of an int64 per rank
and host read), each timed by its slowest rank. Medians over the steps after 3 warm-up steps, and the
ratio check-in / forward; plus the load average before and after (on a shared machine the absolute
times move with it, the ratio less).

    PYTHONPATH=src python bench/ep_check_in.py [--ranks 3] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3sys.ep import apply_ep
from k3sys.model import HybridModel, ModelConfig

RESULTS = Path(__file__).parent / "results" / "ep_check_in.json"
WARMUP = 3


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank: int, world: int, init: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = apply_ep(HybridModel(ModelConfig.from_preset("tiny", num_experts=6)), dist.group.WORLD, capacity=64)
    buf = next(m for m in model.modules() if hasattr(m, "buffer")).buffer
    ids = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    forward, check_in = [], []
    with torch.no_grad():
        for step in range(WARMUP + steps):
            dist.barrier()
            t0 = time.perf_counter()
            model(ids)
            t1 = time.perf_counter()
            buf.check_in()
            t2 = time.perf_counter()
            f, c = _slowest(t1 - t0), _slowest(t2 - t1)
            if step >= WARMUP:
                forward.append(f)
                check_in.append(c)
    if rank == 0:
        Path(out).write_text(json.dumps({"forward_s": forward, "check_in_s": check_in}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.json"
        mp.spawn(_worker, args=(args.ranks, init, args.steps, out), nprocs=args.ranks)
        times = json.loads(Path(out).read_text())
    forward, check_in = statistics.median(times["forward_s"]), statistics.median(times["check_in_s"])
    result = {"ranks": args.ranks, "steps": args.steps, "forward_ms": forward * 1e3, "check_in_ms": check_in * 1e3,
              "check_in_over_forward": check_in / forward, "load_before": load_before,
              "load_after": os.getloadavg()[0]}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.ranks} ranks: forward {forward * 1e3:.1f} ms (check-in included), check-in alone "
          f"{check_in * 1e3:.3f} ms = {check_in / forward:.2%} of a forward; load {load_before:.1f} -> "
          f"{result['load_after']:.1f}")


if __name__ == "__main__":
    main()
