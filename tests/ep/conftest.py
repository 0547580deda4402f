from __future__ import annotations

from collections.abc import Iterator

import pytest
from rank_pool import RankPool

_pool: RankPool | None = None


@pytest.fixture(scope="session")
def _session_pool() -> Iterator[None]:
    yield
    if _pool is not None:
        _pool.close()


@pytest.fixture
def ranks(_session_pool: None) -> RankPool:
    """Four gloo ranks (plus subgroups {0, 1} and {0, 1, 2}), started once per session, restarted after a hang."""
    global _pool
    if _pool is None or not _pool.alive:
        _pool = RankPool(4)
    return _pool
