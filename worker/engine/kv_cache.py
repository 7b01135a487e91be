"""The paged KV pool of one model and the per-forward addressing into it.

A forward pass feeds each sequence a run of new tokens (a prefill chunk, one decode token, or
γ+1 verify tokens). ``PagedBatch`` turns (start position, run length, block table) per sequence
into the index tensors every layer reuses: where to write the new K/V (slot mapping), which
blocks to gather for attention, and the causal mask. It is built once per forward, so the
per-layer work is a fixed handful of batched tensor ops with no Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """One preallocated pool of fixed-size blocks for all layers of one model.

    The pool tensors can be reallocated larger or smaller (``resize``) with a block migration
    map, so a memory manager can grow the pool into freed space or shrink it back.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # k: [num_layers, num_blocks, block_size, n_kv_heads, head_dim]; v the same
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def resize(self, num_blocks: int, moves: dict[int, int] | None = None) -> None:
        """Reallocate to ``num_blocks``; block ``src`` is copied to ``dst`` for each move, and
        blocks below min(old, new) keep their index. The caller updates block tables."""
        old_k, old_v = self.k, self.v
        keep = min(num_blocks, old_k.shape[1])
        shape = (self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k[:, :keep] = old_k[:, :keep]
        self.v[:, :keep] = old_v[:, :keep]
        for src, dst in (moves or {}).items():
            self.k[:, dst] = old_k[:, src]
            self.v[:, dst] = old_v[:, src]


@dataclass
class AttnGroup:
    """Runs attended together: rows [start, end) of the flat order, B runs padded to Q x T."""

    start: int
    end: int
    gather: torch.Tensor  # [B * max_blocks] block ids to gather (padded with block 0, masked)
    mask: torch.Tensor  # [B, 1, Q, T] bool, True where the query may attend to the key
    pad_index: torch.Tensor | None  # [end - start] row of each token in the padded [B * Q] layout; None if uniform
    batch: int
    q_max: int
    t_max: int
    _mask_rep: torch.Tensor | None = None
    _mask_add: torch.Tensor | None = None

    def mask_rep(self, rep: int) -> torch.Tensor:
        """[B, 1, Q * rep, T]: the mask for query rows (q, r) laid out q-major (see model._attend);
        built once per forward, reused by every layer."""
        if self._mask_rep is None:
            self._mask_rep = self.mask.repeat_interleave(rep, dim=2)
        return self._mask_rep

    def additive_mask(self, rep: int, dtype: torch.dtype) -> torch.Tensor:
        """mask_rep(rep) as 0 where a query may attend and -inf where not, in dtype; built once per forward."""
        if self._mask_add is None or self._mask_add.dtype != dtype:
            m = self.mask if rep == 1 else self.mask_rep(rep)
            self._mask_add = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        return self._mask_add


@dataclass
class PagedBatch:
    """Addressing for one forward pass over runs of new tokens (N rows in flat order).

    Runs are attended in groups: the leading runs that share one length (decode / verify: no
    padding at all) and the rest (prefill chunks, padded to their longest). Mixing them in one
    padded group would pad every decode row to the prefill chunk's length.
    """

    positions: torch.Tensor  # [N] absolute position of each new token
    slots: torch.Tensor  # [N] flat slot (block * block_size + offset) to write its K/V
    groups: list[AttnGroup]
    max_position: int


def _group(starts: list[int], q_lens: list[int], tables: list[list[int]], block_size: int, row0: int,
           device: torch.device) -> tuple[AttnGroup, list[int], list[int]]:
    """-> (group, positions, slots). Index math in plain Python lists and one torch.tensor
    per result: for a batch of decode rows that is several times cheaper than tensor ops."""
    b = len(starts)
    q_max = max(q_lens)
    max_blocks = max((s + q + block_size - 1) // block_size for s, q in zip(starts, q_lens))
    rows = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in tables]  # [B, max_blocks]
    positions: list[int] = []
    slots: list[int] = []
    qpos: list[list[int]] = []  # [B, Q] position of each padded query row (pads repeat the last)
    pad_index: list[int] = []
    uniform = all(q == q_max for q in q_lens)
    for i, (s, q) in enumerate(zip(starts, q_lens)):
        ps = list(range(s, s + q))
        positions += ps
        row = rows[i]
        slots += [row[p // block_size] * block_size + p % block_size for p in ps]
        qpos.append(ps + [ps[-1]] * (q_max - q))
        if not uniform:
            pad_index += range(i * q_max, i * q_max + q)
    t_max = max_blocks * block_size
    qpos_t = torch.tensor(qpos, dtype=torch.long)
    mask = (torch.arange(t_max).view(1, 1, t_max) <= qpos_t.unsqueeze(2)).unsqueeze(1)  # [B, 1, Q, T]
    group = AttnGroup(row0, row0 + len(positions), torch.tensor(rows, dtype=torch.long).view(-1).to(device),
                      mask.to(device), None if uniform else torch.tensor(pad_index, dtype=torch.long).to(device),
                      b, q_max, t_max)
    return group, positions, slots


def build_paged_batch(starts: list[int], q_lens: list[int], tables: list[list[int]], block_size: int,
                      device: torch.device) -> PagedBatch:
    """starts[b]: position of the first new token of run b (= tokens already in that KV)."""
    split = 1
    while split < len(q_lens) and q_lens[split] == q_lens[0]:
        split += 1
    parts = [(0, split), (split, len(q_lens))] if split < len(q_lens) else [(0, split)]
    groups, positions, slots = [], [], []
    row = 0
    for lo, hi in parts:
        g, pos, sl = _group(starts[lo:hi], q_lens[lo:hi], tables[lo:hi], block_size, row, device)
        groups.append(g)
        positions += pos
        slots += sl
        row = g.end
    return PagedBatch(positions=torch.tensor(positions, dtype=torch.long).to(device),
                      slots=torch.tensor(slots, dtype=torch.long).to(device), groups=groups,
                      max_position=max(s + q for s, q in zip(starts, q_lens)) - 1)
