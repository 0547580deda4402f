"""bf16 in Triton's CPU interpreter, made to behave like a GPU.

The interpreter holds bf16 tensors as raw uint16 bit patterns: its tl.dot multiplies those integers, and
its fp32 -> bf16 cast truncates. GPUs multiply the bf16 values exactly (fp32 accumulation) and round to
nearest even. `patch_bf16` gives the interpreter those two semantics, so the bf16 kernels compute on CPU
what they compute on a GPU; it touches nothing unless the kernels run interpreted.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaN kept NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def patch_bf16() -> bool:
    """Patch the interpreter once; False if its internals are not the ones this was written against."""
    try:
        from triton.runtime import interpreter as it

        builder, convert, handle = it.InterpreterBuilder, it._convert_float, it.TensorHandle
        dot = builder.create_dot
    except (ImportError, AttributeError):
        return False
    if getattr(builder, "_k3sys_bf16", False):
        return True

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _f32_to_bf16(input)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a, b = (handle(_bf16_to_f32(x.data), tl.float32) for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    it._convert_float = convert_float
    builder.create_dot = create_dot
    builder._k3sys_bf16 = True
    return True
