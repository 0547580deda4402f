"""Names and trees on the host: fresh ids, and removing a directory tree a sandbox wrote without
following its links."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

_log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    """`<prefix>-<12 hex digits>`, random."""
    return f"{prefix}-{secrets.token_hex(6)}"


def remove_tree(path: Path) -> None:
    """Remove `path` and everything below it: without recursion (a sandbox's tree can be any depth),
    without following links (only the current directory is held open: descend by name, climb by
    ".."), never raising (an error is logged and what is left stays)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
        cur = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    except OSError as e:
        _log.warning("cannot remove %s: %s", path, e)
        return
    names: list[str] = []  # the directories we are in, below `path`
    try:
        while True:
            sub = None
            with os.scandir(cur) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        sub = sub or e.name
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(e.name, dir_fd=cur)
            if sub is not None:
                down = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cur)
                os.close(cur)
                cur = down
                names.append(sub)
            elif names:
                up = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
                os.close(cur)
                cur = up
                os.rmdir(names.pop(), dir_fd=cur)
            else:
                break
        os.rmdir(path)
    except OSError as e:
        _log.warning("cannot remove %s (at depth %d): %s", path, len(names), e)
    finally:
        os.close(cur)
