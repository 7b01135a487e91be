"""CPU attention over the paged KV pool without gathering it (csrc/paged_attention.c).

``paged_attention`` is used for groups of short runs (decode and verify); prefill chunks keep
torch's SDPA, which is GEMM-shaped and fast there. The C source is compiled with the system's C
compiler on first use into a cache folder keyed by its hash; with no compiler the model falls
back to the gather + SDPA path and logs why once. NIGHTJAR_KERNEL_MARCH (default ``native``)
sets the target CPU; an image built for many hosts prebuilds it for a portable one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
MAX_RUN = 16  # longer runs (prefill chunks) go to SDPA
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    base = os.environ.get("NIGHTJAR_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nightjar", "kernels")
    return Path(base)


def _build() -> ctypes.CDLL:
    march = os.environ.get("NIGHTJAR_KERNEL_MARCH", "native")
    flags = ["-O3", f"-march={march}", "-fopenmp-simd", "-fPIC", "-shared"]
    # a native build is only good for this host's CPU
    host = [platform.machine()] + ([platform.node()] if march == "native" else [])
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags + host).encode())
    target = cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise RuntimeError("no C compiler (set CC or install gcc)")
        target.parent.mkdir(parents=True, exist_ok=True)
        # build to a private name, then rename: workers starting together never load a half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lpthread", "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{cc} failed: {e.stderr.strip()[-400:]}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                    ctypes.c_float, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (logged once)."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("NIGHTJAR_PAGED_ATTENTION", "1") == "0":
                log.info("paged attention kernel disabled by NIGHTJAR_PAGED_ATTENTION=0")
            else:
                try:
                    _lib = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    log.warning("paged attention kernel unavailable, using gather + SDPA: %s", e)
        return _lib


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
    lib = _lib  # built by usable(); no lock on the per-layer path
    assert lib is not None, "paged_attention called where usable() is False"
    status = lib.paged_attention(q.data_ptr(), q.stride(0), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(),
                                 tables.numel() // batch, kc.shape[0], pos.data_ptr(), out.data_ptr(), batch, q_len, h,
                                 k, d, bs, d ** -0.5, torch.get_num_threads())
    if status:
        raise {1: MemoryError("paged attention: out of memory for its score buffer"),
               2: ValueError(f"paged attention: unsupported heads {h}/{k} of size {d}"),
               3: IndexError("paged attention: a position or block id outside the KV pool")}[status]
    return out
