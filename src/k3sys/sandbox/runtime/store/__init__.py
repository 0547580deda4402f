"""Content-addressed chunk store behind incremental sandbox checkpoints.

    store = Store("/var/lib/k3sys/store")
    m = store.commit({"criu": image_dir, "upper": upper_dir}, parent=previous_id)
    store.checkout(m.id, {"criu": restore_dir, "upper": new_upper})

See `store.py` for the layout, durability and concurrency rules, `chunker.py` for how files are cut,
`follower.py` for packing CRIU's images while CRIU writes them.
"""

from k3sys.sandbox.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptStoreError,
    StoreError,
    StoreInputError,
)
from k3sys.sandbox.runtime.store.follower import Follower
from k3sys.sandbox.runtime.store.manifest import Entry, Manifest
from k3sys.sandbox.runtime.store.store import Store

__all__ = [
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptStoreError",
    "Entry",
    "Follower",
    "Manifest",
    "Store",
    "StoreError",
    "StoreInputError",
]
