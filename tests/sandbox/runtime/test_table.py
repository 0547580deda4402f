"""The sandbox table without runc: its one transition table, `transition` (allowed, refused, rolled
back on an exception, each change persisted) and the layers its records hold."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from k3sys.sandbox import InvalidStateError, NotFoundError
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.state import LIVE, TRANSITIONS, Record, State
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.spec import SandboxSpec


def table(tmp_path: Path) -> SandboxTable:
    for d in ("sandboxes", "layers", "tmp"):
        (tmp_path / d).mkdir()
    return SandboxTable(tmp_path, LayerSet(tmp_path / "layers", tmp_path / "tmp", lambda ck, dest: dest.mkdir()))


def new_record(t: SandboxTable, state: State = State.RUNNING, **fields) -> Record:
    rec = Record(t.claim_id(None), SandboxSpec(), state, time.time(), **fields)
    t.register(rec)
    t.save(rec)
    return rec


def on_disk(t: SandboxTable, rec: Record) -> Record:
    return Record.load(t.dirs(rec.id).root / "record.json")


def test_the_transition_table_is_checked_on_every_change(tmp_path):
    t = table(tmp_path)
    rec = new_record(t)
    t.set(rec, State.PAUSED)
    with pytest.raises(RuntimeError, match="no transition paused -> resuming"):
        t.set(rec, State.RESUMING)
    assert rec.state is State.PAUSED and on_disk(t, rec).state is State.PAUSED
    t.set(rec, State.PAUSED, reason="same state, other fields")  # never refused
    assert on_disk(t, rec).reason == "same state, other fields"
    assert all(State.KILLED in nxt and State.LOST in nxt for s, nxt in TRANSITIONS.items() if s is not State.KILLED)
    assert TRANSITIONS[State.KILLED] == frozenset()


def test_transition_sets_via_then_to_and_refuses_other_states(tmp_path):
    t = table(tmp_path)
    rec = new_record(t, State.HIBERNATED, head="ck-a")
    with (pytest.raises(InvalidStateError, match="cannot pause sandbox .* it is hibernated"),
          t.transition(rec.id, LIVE, State.CHECKPOINTING, None, "pause")):
        pass
    with t.transition(rec.id, (State.HIBERNATED,), State.RESUMING, State.RUNNING, "resume") as r:
        assert r is rec and on_disk(t, rec).state is State.RESUMING and rec.prev is State.HIBERNATED
        t.set(rec, rec.state, layer=rec.head)
    assert (rec.state, rec.prev, on_disk(t, rec).state) == (State.RUNNING, None, State.RUNNING)
    with t.transition(rec.id, LIVE, State.CHECKPOINTING, None, "checkpoint"):
        pass
    assert rec.state is State.RUNNING  # `to` None: back where it was


def test_transition_rolls_back_on_an_exception(tmp_path):
    t = table(tmp_path)
    rec = new_record(t, State.PAUSED)
    with (pytest.raises(OSError, match="injected"),
          t.transition(rec.id, LIVE, State.HIBERNATING, State.HIBERNATED, "hibernate")):
        raise OSError("injected")
    assert (rec.state, rec.prev) == (State.PAUSED, None)
    assert on_disk(t, rec).state is State.PAUSED


def test_records_hold_their_layers_until_dropped(tmp_path):
    t = table(tmp_path)
    a = new_record(t, layer="ck-a")
    b = new_record(t, State.HIBERNATED, head="ck-b", layer=None)
    assert t.layers.counts() == {"ck-a": 1, "ck-b": 1}
    with t.transition(b.id, (State.HIBERNATED,), State.RESUMING, State.RUNNING, "resume"):
        t.set(b, b.state, layer="ck-a")  # resuming: holds its head and, now, ck-a
    assert t.layers.counts() == {"ck-a": 2}  # running on ck-a: ck-b released
    with t.locked(a.id) as rec:
        t.drop(rec)
    with pytest.raises(NotFoundError), t.locked(a.id):
        pass
    assert t.layers.counts() == {"ck-a": 1} and [r.id for r in t.records()] == [b.id]
