"""Host-side chunk bookkeeping shared by every launch: sequences, chunks, and the maps between them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

CHUNK = 16  # tokens per chunk: a 16x16 inverse, and MMA-shaped tiles (FlashKDA's choice)


@dataclass(frozen=True)
class Chunks:
    """How packed tokens split into chunks.

    cu_seqlens `[N + 1]` int32 token offsets of the N sequences in the flattened token axis;
    offsets `[N + 1]` int32 chunk offsets (sequence n owns chunks offsets[n] .. offsets[n + 1] - 1);
    indices `[NC, 2]` int32 (sequence, chunk within the sequence) of each of the NC chunks.
    """

    cu_seqlens: torch.Tensor
    offsets: torch.Tensor
    indices: torch.Tensor
    num_chunks: int

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1


def chunk_maps(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> Chunks:
    """Chunk maps for B sequences of length T, or for the packed sequences of `cu_seqlens` (then B == 1).

    Vectorised on the tensors' device; the only host sync is reading the chunk count of a varlen batch.
    Equal-length maps are cached per (B, T, device): a training step reuses them and skips the half dozen
    tiny kernels that build them.
    """
    if cu_seqlens is None:
        return _equal_length_maps(B, T, device)
    return _maps(cu_seqlens.to(device=device, dtype=torch.int64), None)


@lru_cache(maxsize=64)
def _equal_length_maps(B: int, T: int, device: torch.device) -> Chunks:
    return _maps(torch.arange(B + 1, device=device, dtype=torch.int64) * T, B * -(-T // CHUNK))


def _maps(cu: torch.Tensor, num_chunks: int | None) -> Chunks:
    device = cu.device
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    offsets = F.pad(counts.cumsum(0), (1, 0))
    if num_chunks is None:
        num_chunks = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=num_chunks)
    local = torch.arange(num_chunks, device=device) - offsets[seq]
    indices = torch.stack([seq, local], dim=1).to(torch.int32).contiguous()
    return Chunks(cu.to(torch.int32), offsets.to(torch.int32), indices, num_chunks)
