"""CPU matmul that streams each weight once at small row counts.

torch's default CPU path (MKL sgemm) re-reads a weight matrix for every few rows, so a 4-row
verify pass costs several 1-row decode steps and speculation looks expensive at batch 1. The
target's matrices are packed once, and a step's few rows read each packed weight once:

- ``panel``: csrc/panel_linear.c, W^T in 16-column panels [N/16, K, 16] that each stay in L2
  while register tiles of x sweep them. At the bandwidth floor to ~4 rows, then compute-bound
  (BENCHMARKS.md, "CPU linear path"). Needs a C compiler (worker/engine/kernels.py) and N a
  multiple of 16; NIGHTJAR_PANEL_LINEAR=0 turns it off.
- ``onednn``: oneDNN's inner product with the weight reordered once into its blocked layout; flat
  to ~4 rows, the fallback for a matrix the panel kernel cannot take.

Prompt rows are many and compute-bound, and fp32 runs them at ~150 GFLOP/s of one core, so a
prompt token costs over half a batch-64 decode token; on a GPU it costs a few percent.
``pack_bf16`` / ``bf16_linear`` give them oneDNN's bf16 inner product (AMX where the CPU has it,
fp32 accumulation, 5-8x the fp32 rate from 64 rows on): an engine option (EngineConfig.prefill_dtype)
because rounding to bf16 moves the logits off transformers' fp32 ones (BENCHMARKS.md, "Prompts in bf16 on AMX").

CUDA keeps F.linear.
"""

from __future__ import annotations

import ctypes

import torch

from worker.engine import kernels

PANEL = 16  # columns per panel, the kernel's NR
# oneDNN picks the blocked layout for this row-count hint; decode and verify passes are mostly few rows,
# prompt chunks many.
PACK_ROWS_HINT = 16
PREFILL_ROWS_HINT = 256


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def can_bf16() -> bool:
    """oneDNN has a native bf16 path on this CPU (AMX or AVX512-BF16), not an emulated one."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_bf16_prefill(device: str, dtype: str) -> bool:
    """An engine on ``device`` in ``dtype`` can prefill in bf16: a packed fp32 CPU target, and a
    native bf16 path."""
    return device == "cpu" and dtype == "float32" and can_bf16()


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.panel_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.panel_linear.restype = None


def kernel() -> ctypes.CDLL | None:
    return kernels.load("panel_linear", "NIGHTJAR_PANEL_LINEAR", _declare)


def pack(w: torch.Tensor, kind: str = "auto") -> torch.Tensor:
    """w: [out, in] fp32 CPU -> panels [out/16, in, 16] (``panel``) or oneDNN's opaque blocked layout
    [out, in] (``onednn``); ``auto`` takes panels where the kernel is built and out % 16 == 0.
    Either keeps w's element count."""
    if not can_pack(w.device, w.dtype) or w.dim() != 2:
        raise ValueError(f"pack takes a 2-D fp32 CPU weight, got {w.dtype} {tuple(w.shape)} on {w.device}")
    if kind not in ("auto", "panel", "onednn"):
        raise ValueError(f"pack: kind must be auto, panel or onednn, not {kind!r}")
    n, k = w.shape
    if kind == "panel" or (kind == "auto" and n % PANEL == 0 and kernel() is not None):
        if n % PANEL or kernel() is None:
            raise ValueError(f"panel packing needs the kernel and out % {PANEL} == 0 (out = {n})")
        return w.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()  # [N/16, K, 16]
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """w: [out, in] fp32 CPU -> bf16 in oneDNN's blocked layout for many rows (opaque, [out, in])."""
    if not can_pack(w.device, w.dtype) or w.dim() != 2:
        raise ValueError(f"pack_bf16 takes a 2-D fp32 CPU weight, got {w.dtype} {tuple(w.shape)} on {w.device}")
    return torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), PREFILL_ROWS_HINT)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
                bf16_out: bool = False) -> torch.Tensor:
    """x: [N, in] fp32 or bf16, w: pack_bf16's [out, in] -> fp32 x @ w^T (+ add) -> [N, out]. x and the
    product are rounded to bf16 (oneDNN accumulates in fp32 but has no fp32 output for bf16 inputs); add
    is added after, in fp32, so the residual stream keeps its precision. ``bf16_out`` (no add) returns
    the bf16 product as it is, for a next bf16 op: a prompt chunk's [N, 2I] cast to fp32 and back
    costs more than its matmul."""
    n = x.shape[0]
    xb = _pad_rows(x.to(torch.bfloat16), padded_rows(n))  # [rows, in]
    y = torch.ops.mkldnn._linear_pointwise(xb, w, None, "none", [], "")[:n]  # [N, out] bf16
    if bf16_out:
        if add is not None:
            raise ValueError("bf16_linear: bf16_out takes no add (it would round the add to bf16)")
        return y
    y = y.float()
    return y if add is None else y.add_(add)


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
    if w.dim() == 3:
        return _panel_linear(x, w, add)
    n = x.shape[0]
    rows = padded_rows(n)
    x = _pad_rows(x, rows)  # [rows, in]
    if add is not None and add.dim() == 2:
        add = _pad_rows(add, rows)  # [rows, out]
    if add is None or add.dim() == 1:
        y = torch.ops.mkldnn._linear_pointwise(x, w, add, "none", [], "")
    else:
        y = torch.ops.mkldnn._linear_pointwise.binary(x, add, w, None, "add")
    return y if rows == n else y[:n]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t: [n, k] -> [rows, k], zero rows appended (t itself when rows == n)."""
    n = t.shape[0]
    return t if rows == n else torch.cat([t, t.new_zeros(rows - n, t.shape[1])])


def _panel_linear(x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """x: [N, K], w: panels [P, K, 16], add: [P * 16] | [N, P * 16] | None -> [N, P * 16]."""
    p, k, _ = w.shape
    n_out = p * PANEL
    if x.shape[-1] != k:
        raise ValueError(f"packed_linear: x has {x.shape[-1]} features, the weight takes {k}")
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, n_out, dtype=x.dtype)  # [N, out]
    bias = res = None
    if add is not None:
        add = add.contiguous()
        if add.shape != ((n_out,) if add.dim() == 1 else (rows, n_out)):
            raise ValueError(f"packed_linear: add of shape {tuple(add.shape)} for an output of {rows} x {n_out}")
        bias, res = (add.data_ptr(), None) if add.dim() == 1 else (None, add.data_ptr())
    if rows:
        kernel().panel_linear(x.data_ptr(), rows, k, w.data_ptr(), n_out, bias, res, y.data_ptr(),
                              torch.get_num_threads())
    return y
