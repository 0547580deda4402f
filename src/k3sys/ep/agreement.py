"""How the ranks of an expert-parallel step agree that it failed, so that none is left in a collective.

A step has points where every rank reads a few integers that all ranks gathered: the counts
all-gather of `EPBuffer.dispatch` (which every step makes anyway) and `EPBuffer.check_in` (one tiny
all-gather at the end of a model forward under `apply_ep`). Each rank puts a verdict there: 0, or the
code of what went wrong on it. Every rank sees the same verdicts at the same point, so when one is
not 0 every rank raises there and no rank goes on to a collective the others will not join: the ranks
exchange the failed ranks' messages (one more all-gather, on this path only), the failed rank raises
ValueError (or re-raises its own error), the others `RemoteInputError` / `RemoteStepError` naming it
and its message. The group stays usable.

Exceptions (raised on the ranks that did nothing wrong):
    RuntimeError
     └── RemoteStepError: another rank's step failed (its code raised); this rank stops with it.
          └── RemoteInputError: another rank rejected its input to the step.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["CALLER", "FAILED", "PROBLEMS", "VALUES", "RemoteInputError", "RemoteStepError", "raise_on_verdicts"]

# Verdict codes: layout problems 1-4 (found on the host), value problems from VALUES on (found on the
# device), a caller's own input check (`EPBuffer.abort`), and a failure of the step's own code.
PROBLEMS = ("", "x", "capacity", "topk_ids", "topk_weights", "topk_ids out of range", "topk_ids repeated",
            "x not finite", "topk_weights not finite", "caller's check", "failed")
VALUES = 5
CALLER = 9
FAILED = 10


class RemoteStepError(RuntimeError):
    """Another rank's step failed; this rank stops with it instead of waiting in a collective."""


class RemoteInputError(RemoteStepError):
    """Another rank rejected its input to a collective step; this rank stops with it instead of hanging."""


def raise_on_verdicts(group: dist.ProcessGroup, verdicts: list[int], message: str | None, where: str) -> None:
    """Return if every verdict is 0; else raise on every rank (all call it with the same verdicts).

    Args:
        group: the step's process group.
        verdicts: `[R]` every rank's code (host ints, identical on every rank).
        message: this rank's description of its problem when its verdict is not 0 (ignored otherwise).
        where: what the errors name as the failed call, e.g. "EPBuffer.dispatch".

    Raises:
        ValueError(message) on a rank whose verdict is not 0; on the others `RemoteStepError` (or
        `RemoteInputError` when every failed rank rejected its input) naming each failed rank and its
        message.
    """
    if not any(verdicts):
        return
    rank = dist.get_rank(group)
    mine = verdicts[rank]
    messages: list[str | None] = [None] * len(verdicts)
    dist.all_gather_object(messages, message if mine else None, group=group)
    if mine:
        raise ValueError(f"{where} on rank {rank}: {message}")
    bad = [r for r, code in enumerate(verdicts) if code]
    told = "; ".join(f"rank {r} failed: {messages[r]}" if verdicts[r] == FAILED
                     else f"rank {r} rejected its input ({PROBLEMS[verdicts[r]]}): {messages[r]}" for r in bad)
    error = RemoteStepError if any(verdicts[r] == FAILED for r in bad) else RemoteInputError
    raise error(f"{where}: {told}; rank {rank} stops too")
