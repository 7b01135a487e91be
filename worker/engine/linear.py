"""CPU matmul that streams each weight once at small row counts: oneDNN with a prepacked weight.

torch's default CPU path (MKL sgemm) re-reads a weight matrix for every few rows, so a 4-row
verify pass costs several 1-row decode steps and speculation looks expensive at batch 1. oneDNN's
inner product, with the weight reordered once into its blocked layout, reads the weight once for
up to ~8-16 rows and is compute-bound beyond: the shape of a GPU step (BENCHMARKS.md, "CPU linear
path"). CUDA keeps F.linear.
"""

from __future__ import annotations

import torch

# oneDNN picks the blocked layout for this row-count hint; decode and verify passes are mostly few rows.
PACK_ROWS_HINT = 16


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(w: torch.Tensor) -> torch.Tensor:
    """w: [out, in] fp32 CPU -> the same matrix in oneDNN's opaque blocked layout (same numel)."""
    if not can_pack(w.device, w.dtype) or w.dim() != 2:
        raise ValueError(f"pack takes a 2-D fp32 CPU weight, got {w.dtype} {tuple(w.shape)} on {w.device}")
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)


def padded_rows(n: int) -> int:
    """n rounded up so that few distinct row counts reach oneDNN: exact up to 16, then to a
    multiple of 2^(bits(n-1) - 4), i.e. at most 1/8 of the rows wasted. Each row count oneDNN
    sees keeps a compiled kernel for good, and every count up to 512 costs hundreds of MB."""
    if n <= 16:
        return n
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step


def packed_linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, in], w: packed [out, in] -> x @ w^T (+ add: a bias [out] or a residual [N, out]) -> [N, out]."""
    n = x.shape[0]
    rows = padded_rows(n)
    if rows != n:
        x = torch.cat([x, x.new_zeros(rows - n, x.shape[1])])  # [rows, in]
        if add is not None and add.dim() == 2:
            add = torch.cat([add, add.new_zeros(rows - n, add.shape[1])])  # [rows, out]
    if add is None or add.dim() == 1:
        y = torch.ops.mkldnn._linear_pointwise(x, w, add, "none", [], "")
    else:
        y = torch.ops.mkldnn._linear_pointwise.binary(x, add, w, None, "add")
    return y if rows == n else y[:n]
