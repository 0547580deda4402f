"""Disks made ahead (diskpool.py): each handed out once, fresh and empty, of the size asked for; the
pool stays bounded and gives everything back on close or after a crash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from waiting import wait_until

from k3sys.sandbox.runtime.drivers import disk
from k3sys.sandbox.runtime.drivers.diskpool import DiskPool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loop devices and mounts need root")


def _filled(pool: DiskPool, n: int) -> None:
    pool.refill()
    wait_until(lambda: pool.held() >= n, 20, f"the pool holding {n} disks")


def _device_of(target: Path) -> str:
    with open("/proc/self/mountinfo") as f:
        return next(line.split(" - ")[1].split()[1] for line in f if line.split()[4] == str(target))


def _attached(dev: str) -> bool:
    return Path(f"/sys/block/{Path(dev).name}/loop/backing_file").exists()


def test_pooled_disks_are_fresh_distinct_and_sized(tmp_path):
    pool = DiskPool(tmp_path / "cache")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    try:
        pool.create(a / "disk.img", a / "mnt", 64)  # empty pool: made in place
        (a / "mnt" / "secret").write_bytes(b"x" * 4096)
        _filled(pool, 1)
        pool.create(b / "disk.img", b / "mnt", 64)  # from the pool
        assert pool.held() == 0
        assert not any((tmp_path / "cache" / "pool").iterdir()), "the image moved into the sandbox"
        assert sorted(p.name for p in (b / "mnt").iterdir()) == ["lost+found"]
        assert _device_of(a / "mnt") != _device_of(b / "mnt")
        st = os.statvfs(b / "mnt")
        assert 56 << 20 <= st.f_blocks * st.f_frsize <= 64 << 20
        assert (b / "disk.img").stat().st_size == 64 << 20
    finally:
        pool.close()
        for d in (a, b):
            disk.remove(d / "disk.img", d / "mnt")


def test_close_detaches_and_deletes_pooled_disks(tmp_path):
    pool = DiskPool(tmp_path / "cache")
    pool.create(tmp_path / "disk.img", tmp_path / "mnt", 64)
    _filled(pool, 1)
    (_, dev, _), = pool._ready[64]
    assert _attached(dev)
    pool.close()
    disk.remove(tmp_path / "disk.img", tmp_path / "mnt")
    assert pool.held() == 0 and not any((tmp_path / "cache" / "pool").iterdir())
    assert not _attached(dev)
    pool.refill()  # closed: nothing is made any more
    assert pool._filling is None or not pool._filling.is_alive()


def test_pool_keeps_only_the_last_sizes_and_clears_a_crashed_runtimes_images(tmp_path):
    (tmp_path / "cache" / "pool").mkdir(parents=True)
    (tmp_path / "cache" / "pool" / "4242-1.img").write_bytes(b"left by a dead runtime")
    pool = DiskPool(tmp_path / "cache", sizes=2)
    assert not any((tmp_path / "cache" / "pool").iterdir())
    try:
        for i, mb in enumerate((64, 96, 128)):
            d = tmp_path / str(i)
            d.mkdir()
            pool.create(d / "disk.img", d / "mnt", mb)
            disk.remove(d / "disk.img", d / "mnt")
        _filled(pool, 2)
        assert sorted(pool._ready) == [96, 128]
        assert len(list((tmp_path / "cache" / "pool").iterdir())) == 2
    finally:
        pool.close()
