"""CPU attention over the paged KV pool without gathering it (csrc/paged_attention.c).

``paged_attention`` is used for groups of short runs (decode and verify); prefill chunks keep
torch's SDPA, which is GEMM-shaped and fast there. The C source is built on first use
(worker/engine/kernels.py); with no compiler, or NIGHTJAR_PAGED_ATTENTION=0, the model falls back
to the gather + SDPA path.
"""

from __future__ import annotations

import ctypes

import torch

from worker.engine import kernels

MAX_RUN = 16  # longer runs (prefill chunks) go to SDPA


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                    ctypes.c_float, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (logged once)."""
    return kernels.load("paged_attention", "NIGHTJAR_PAGED_ATTENTION", _declare)


def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and head_dim <= 256
            and kernel() is not None)


def paged_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                    pos: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """q: [B * Q, H, d] (rows may be strided: a slice of q|k), kc, vc: [num_blocks, block_size, K, d],
    tables: [B * max_blocks] block ids, pos: [B * Q] position of each query row -> [B * Q, H * d].
    Row b * Q + i is token i of run b and sees keys 0 … pos of its sequence."""
    n, h, d = q.shape
    _, bs, k, _ = kc.shape
    assert n == batch * q_len and q.stride(2) == 1 and q.stride(1) == d and kc.is_contiguous() and vc.is_contiguous()
    assert tables.dtype == pos.dtype == torch.int64 and tables.is_contiguous() and pos.is_contiguous()
    out = torch.empty(n, h * d, dtype=q.dtype)
    lib = kernel()
    assert lib is not None, "paged_attention called where usable() is False"
    status = lib.paged_attention(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(),
                                 tables.numel() // batch, kc.shape[0], pos.data_ptr(), out.data_ptr(), batch, q_len, h,
                                 k, d, bs, d ** -0.5, torch.get_num_threads())
    if status:
        raise {1: MemoryError("paged attention: out of memory for its score buffer"),
               2: ValueError(f"paged attention: unsupported heads {h}/{k} of size {d}"),
               3: IndexError("paged attention: a position or block id outside the KV pool")}[status]
    return out
