"""Triton kernels for KDA's chunked form: phase 1 (intra-chunk, token-parallel), phase 2 (inter-chunk, recurrent).

`kda_triton` is the differentiable op behind `kda_chunk(..., backend="triton")`; `kda_triton_fused`
(forward only) runs both phases in one kernel and exists to measure what the split buys.
"""

from k3sys.kda.triton.op import kda_triton, kda_triton_fused, triton_unsupported

__all__ = ["kda_triton", "kda_triton_fused", "triton_unsupported"]
