"""k3sys: runnable implementations of the three system designs in Kimi K3's technical report.

- `k3sys.kda`: Kimi Delta Attention (naive oracle, two-phase chunked op, decode step, layer).
- `k3sys.ep`: expert parallelism with an online redundant-expert planner.
- `k3sys.sandbox`: agent sandboxes with pause / resume / fork / incremental checkpoint.
- `k3sys.model`: the hybrid KDA + gated-MLA + MoE decoder that ties them together.
"""

__version__ = "0.1.0"
