"""DraftMover: the draft model's weights between the device and host memory.

Offload copies every weight tensor into host buffers and then drops the device tensors;
reload allocates fresh device tensors and copies the host buffers back. In between, the
model holds zero-size placeholders, so a forward that ran by mistake fails loudly instead of
reading freed memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker.engine.model import LlamaModel


@dataclass(frozen=True)
class Transfer:
    """One completed weight move."""

    direction: str  # "offload" (device -> host) | "reload" (host -> device)
    nbytes: int
    seconds: float  # copy time, summed over the chunks (CUDA: measured by events on the side stream)
    unix_ms: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _slots(model: LlamaModel) -> list[tuple[dict, str]]:
    """(container, key) of every distinct weight; a tied head is skipped (restored by ``_retie``)."""
    w = model.w
    out: list[tuple[dict, str]] = [(w, "embed"), (w, "norm")]
    if w["head"] is not w["embed"]:
        out.append((w, "head"))
    for layer in w["layers"]:
        out.extend((layer, k) for k, t in layer.items() if t is not None)
    return out


COPY_CHUNK_BYTES = 64 << 20  # the most a decode step waits behind (BENCHMARKS.md, "On a GPU (NVIDIA H200)")


def _pieces(dst: list[torch.Tensor], src: list[torch.Tensor], chunk_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) views of at most ``chunk_bytes`` each, covering every tensor (flat views of
    contiguous weights; a tensor larger than a chunk is split)."""
    out = []
    for d, s in zip(dst, src):
        d1, s1 = d.view(-1), s.view(-1)
        step = max(1, chunk_bytes // max(1, s1.element_size()))
        out.extend((d1[i:i + step], s1[i:i + step]) for i in range(0, s1.numel(), step))
    return out


class DraftMover:
    """On CUDA the host buffers are pinned (page-locked, so the DMA engine can copy them while the
    GPU computes), allocated once when the engine starts and reused by every cycle (pinning is
    slow and fragments host memory; on the CPU they are allocated at the first offload). Copies
    run on a side ``torch.cuda.Stream``; a ``torch.cuda.Event`` marks completion, and the engine polls ``event.query()`` between steps,
    so the decode loop never waits on a transfer.

    The copy is paced: at most ``chunk_bytes`` are queued at a time, the next chunk when the engine
    polls and finds the last one done. Copies in one direction share the GPU's copy engine, so a
    decode step's own small copies (inputs up, sampled ids down) queue behind whatever transfer is
    in flight: unpaced, one copy of the whole draft held a decode step for all of its length
    (BENCHMARKS.md, "On a GPU (NVIDIA H200)"). Paced, a step waits behind one chunk at most, and
    the move takes more steps.

    On CPU the same code runs synchronously (each chunk is copied when it is queued): the
    host buffers are ordinary tensors, the "device" copy really is freed on offload and really
    reallocated on reload, so the accounting and the tensor lifetimes are the ones a GPU sees.

    Weights never change, so the host copy stays valid after a reload; every offload still
    copies (the measured transfer is the one a first offload pays).
    """

    def __init__(self, model: LlamaModel, chunk_bytes: int = COPY_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.model = model
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.tied = model.w["head"] is model.w["embed"]
        self.slots = _slots(model)
        self.nbytes = sum(c[k].numel() * c[k].element_size() for c, k in self.slots)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._host: list[torch.Tensor] | None = None  # pinned on CUDA; kept for the next cycle
        # pinning is slow (BENCHMARKS.md, "Figures that were code comments"): pay it at start-up, not in a step
        if self.cuda:
            self._host = self._alloc_host()
        self._inflight: list[torch.Tensor] | None = None  # device tensors being read or written
        self._direction: str | None = None
        self._todo: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dst, src) pieces not queued yet
        self._events: tuple | None = None  # (start, end) CUDA events of the chunk in flight
        self._seconds = 0.0  # copy time of the chunks done so far
        self.chunks = 0  # chunks of the transfer in flight (or the last one) queued so far
        self.on_device = True
        self.last: Transfer | None = None

    @property
    def busy(self) -> bool:
        return self._direction is not None

    # ------------------------------------------------------------------ offload

    def start_offload(self) -> None:
        assert self.on_device and not self.busy
        src = [c[k] for c, k in self.slots]
        if self._host is None:
            self._host = self._alloc_host()
        self._copy(self._host, src, "offload")
        self._inflight = src  # keep the device tensors alive until the copy has read them

    def _alloc_host(self) -> list[torch.Tensor]:
        return [torch.empty(c[k].shape, dtype=c[k].dtype, device="cpu", pin_memory=self.cuda) for c, k in self.slots]

    def _finish_offload(self) -> None:
        for c, k in self.slots:  # the device tensors lose their last reference here
            c[k] = torch.empty(0, dtype=self.model.dtype, device=self.device)
        self._retie()
        self.on_device = False

    # ------------------------------------------------------------------ reload

    def start_reload(self) -> None:
        assert not self.on_device and not self.busy and self._host is not None
        dst = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in self._host]
        self._copy(dst, self._host, "reload")
        self._inflight = dst

    def _finish_reload(self) -> None:
        assert self._inflight is not None
        for (c, k), t in zip(self.slots, self._inflight):
            c[k] = t
        self._retie()
        self.on_device = True

    # ------------------------------------------------------------------ the copy

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor], direction: str) -> None:
        self._direction, self._seconds, self.chunks = direction, 0.0, 0
        self._todo = _pieces(dst, src, self.chunk_bytes)
        self._todo.reverse()  # popped from the end, in order
        if self.cuda:
            # the side stream starts after everything already queued on the compute stream
            # (the last forward that read these weights, the allocation of the reload targets)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._queue_chunk()

    def _queue_chunk(self) -> None:
        """Queue the next pieces, up to chunk_bytes (at least one piece)."""
        n = 0
        batch = []
        while self._todo and (not batch or n + self._todo[-1][1].nbytes <= self.chunk_bytes):
            batch.append(self._todo.pop())
            n += batch[-1][1].nbytes
        self.chunks += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record()
                for d, s in batch:
                    d.copy_(s, non_blocking=True)
                end.record()
            self._events = (start, end)
        else:
            t0 = time.perf_counter()
            for d, s in batch:
                d.copy_(s)
            self._seconds += time.perf_counter() - t0

    def poll(self) -> Transfer | None:
        """Between steps, never blocking: if the chunk in flight is done, queue the next one, or
        finish the transfer when none is left -> the Transfer."""
        if not self.busy:
            return None
        if self.cuda:
            start, end = self._events
            if not end.query():
                return None
            self._seconds += start.elapsed_time(end) / 1e3
        if self._todo:
            self._queue_chunk()
            return None
        seconds = self._seconds
        direction, self._direction, self._events = self._direction, None, None
        if direction == "offload":
            self._finish_offload()
        else:
            self._finish_reload()
        self._inflight = None
        self.last = Transfer(direction, self.nbytes, seconds, int(time.time() * 1000))
        return self.last

    def wait(self) -> Transfer | None:
        """Block until the transfer in flight is done (tests and scripts only, never the engine;
        with a MemoryManager use its ``wait``, which also finishes the state transition)."""
        while self.busy:
            if self.cuda:
                self._events[1].synchronize()
            done = self.poll()
            if done is not None:
                return done
        return None

    def _retie(self) -> None:
        if self.tied:
            self.model.w["head"] = self.model.w["embed"]

    @property
    def device_bytes(self) -> int:
        """Draft weight bytes held on the device now (both copies count while one is in flight)."""
        if self.busy:
            return self.nbytes
        return self.nbytes if self.on_device else 0


def plain_copy_seconds(nbytes: int, device: torch.device | str, direction: str, repeats: int = 3,
                       fresh: bool = False) -> float:
    """Best-of time of one plain copy of ``nbytes`` in one tensor: host -> device ("reload") or
    device -> host ("offload"), pinned host memory on CUDA — the physical limit a weight
    transfer is measured against. ``fresh`` allocates the destination each time (what a reload
    does: its device tensors are new), otherwise it is preallocated and warm."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    on_dev = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    src = host if direction == "reload" else on_dev
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if fresh:
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev if direction == "reload" else "cpu",
                              pin_memory=cuda and direction == "offload")
        else:
            dst = on_dev if direction == "reload" else host
            if dst is src:  # CPU: host and device are the same memory kind; copy between two buffers
                dst = host if src is on_dev else on_dev
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
        del dst
    return best
