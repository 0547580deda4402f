"""LayerSet without runc: counts, the last release deletes, concurrent releases delete once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from k3sys.sandbox.runtime.layerset import LayerSet


def fake_layers(tmp_path: Path) -> tuple[LayerSet, list[str]]:
    """A LayerSet whose "store" writes one file per checkout and records the checkouts it made."""
    (tmp_path / "layers").mkdir()
    (tmp_path / "tmp").mkdir()
    made: list[str] = []

    def checkout(ck: str, dest: Path) -> None:
        dest.mkdir()
        (dest / "f").write_text(ck)
        made.append(ck)

    return LayerSet(tmp_path / "layers", tmp_path / "tmp", checkout), made


def test_acquire_ensure_release_deletes_on_the_last(tmp_path):
    ls, made = fake_layers(tmp_path)
    ls.acquire("ck-a")
    ls.acquire("ck-a")
    assert (ls.ensure("ck-a") / "f").read_text() == "ck-a"
    assert ls.ensure("ck-a") == ls.path("ck-a") and made == ["ck-a"]  # checked out once
    ls.release("ck-a")
    assert ls.path("ck-a").exists() and ls.counts() == {"ck-a": 1}
    ls.release("ck-a")
    assert not ls.path("ck-a").exists() and ls.counts() == {}
    assert list((tmp_path / "tmp").iterdir()) == []
    with pytest.raises(RuntimeError, match="released more often"):
        ls.release("ck-a")
    with pytest.raises(RuntimeError, match="without a reference"):
        ls.ensure("ck-a")


def test_update_keeps_a_layer_in_both_and_adopt_moves_a_tree_in(tmp_path):
    ls, made = fake_layers(tmp_path)
    tree = tmp_path / "tmp" / "sealed"
    tree.mkdir()
    ls.update((), {"ck-a"})
    ls.adopt("ck-a", tree)
    assert not tree.exists() and ls.path("ck-a").is_dir() and made == []
    ls.update({"ck-a"}, {"ck-a", "ck-b"})
    assert ls.counts() == {"ck-a": 1, "ck-b": 1} and ls.path("ck-a").is_dir()
    ls.update({"ck-a", "ck-b"}, ())
    assert ls.counts() == {} and list((tmp_path / "layers").iterdir()) == []


def test_concurrent_releases_delete_once_and_a_later_acquire_checks_out_afresh(tmp_path):
    ls, made = fake_layers(tmp_path)
    for _ in range(16):
        ls.acquire("ck-a")
    ls.ensure("ck-a")
    barrier = threading.Barrier(16)

    def drop() -> None:
        barrier.wait()
        ls.release("ck-a")

    threads = [threading.Thread(target=drop) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ls.counts() == {} and not ls.path("ck-a").exists()
    with ls.held("ck-a") as path:
        assert (path / "f").read_text() == "ck-a"
    assert made == ["ck-a", "ck-a"] and not ls.path("ck-a").exists()


def test_sweep_removes_only_what_nobody_holds(tmp_path):
    ls, _ = fake_layers(tmp_path)
    for name in ("ck-kept", "ck-left"):
        (tmp_path / "layers" / name).mkdir()
    ls.acquire("ck-kept")
    assert ls.sweep() == ["ck-left"]
    assert [p.name for p in (tmp_path / "layers").iterdir()] == ["ck-kept"]
