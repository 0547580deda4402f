"""Agent sandboxes with a managed life cycle (AgentENV-style); imports no torch.

- `k3sys.sandbox.store`: content-addressed chunk store behind incremental checkpoints.
- `k3sys.sandbox.errors`: the package's exception tree (`SandboxError` and subclasses).
"""

from k3sys.sandbox.errors import SandboxError, StoreError

__all__ = ["SandboxError", "StoreError"]
