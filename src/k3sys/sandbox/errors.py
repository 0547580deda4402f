"""Exceptions of `k3sys.sandbox`: one base, every failure a subclass that names the problem.

    SandboxError                      base of everything this package raises
    └── StoreError                    the checkpoint store (`k3sys.sandbox.store`)
        ├── CheckpointNotFoundError   unknown checkpoint id (also a LookupError)
        ├── CheckpointExistsError     commit with an id that is already taken
        ├── StoreInputError           bad argument: id, tree, destination, entry path (also a ValueError)
        └── CorruptStoreError         missing or damaged chunk, pack or manifest
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error raised by `k3sys.sandbox`."""


class StoreError(SandboxError):
    """Base class of the checkpoint store's errors."""


class CheckpointNotFoundError(StoreError, LookupError):
    """No checkpoint with the given id."""


class CheckpointExistsError(StoreError):
    """A checkpoint with the given id already exists."""


class StoreInputError(StoreError, ValueError):
    """An argument is not acceptable: an id or tree name, a tree to commit, a checkout destination,
    or an entry path that would leave its tree."""


class CorruptStoreError(StoreError):
    """Stored data is missing or does not match its hash."""
