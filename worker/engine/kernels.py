"""The engine's small C kernels (csrc/), compiled with the system's C compiler on first use.

Each source is built into a cache folder keyed by its hash, the flags and the host, and loaded
with ctypes; a caller that gets None falls back to a torch path and logs why once.
NIGHTJAR_KERNEL_CACHE sets the folder, NIGHTJAR_KERNEL_MARCH (default ``native``) the target CPU:
an image built for many hosts prebuilds them for a portable one. Plain C with no torch headers,
so that a build takes about a second rather than a torch extension's minute.
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
from typing import Callable

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_lock = threading.Lock()
_built: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    base = os.environ.get("NIGHTJAR_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nightjar", "kernels")
    return Path(base)


def _build(name: str) -> ctypes.CDLL:
    source = CSRC / f"{name}.c"
    march = os.environ.get("NIGHTJAR_KERNEL_MARCH", "native")
    flags = ["-O3", f"-march={march}", "-fopenmp-simd", "-fPIC", "-shared"]
    # a native build is only good for this host's CPU
    host = [platform.machine()] + ([platform.node()] if march == "native" else [])
    key = hashlib.sha256(source.read_bytes() + " ".join(flags + host).encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            raise RuntimeError("no C compiler (set CC or install gcc)")
        target.parent.mkdir(parents=True, exist_ok=True)
        # build to a private name, then rename: workers starting together never load a half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, "-o", tmp, str(source), "-lpthread", "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{cc} failed: {e.stderr.strip()[-400:]}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def load(name: str, switch: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """csrc/{name}.c built and loaded once (``declare`` sets its functions' ctypes signatures), or
    None where the environment variable ``switch`` is "0" or no build works (logged once)."""
    if name in _built:  # no lock on the per-layer path
        return _built[name]
    with _lock:
        if name not in _built:
            lib = None
            if os.environ.get(switch, "1") == "0":
                log.info("%s kernel disabled by %s=0", name, switch)
            else:
                try:
                    lib = _build(name)
                    declare(lib)
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    log.warning("%s kernel unavailable, using the torch path: %s", name, e)
            _built[name] = lib
        return _built[name]
