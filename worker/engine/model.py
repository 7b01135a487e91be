"""Our own Llama-family forward pass (Llama, Mistral, Qwen2) over a paged KV cache.

No nn.Module tree: on a CPU a tiny model's step is dominated by per-op overhead, so a layer is
a fixed sequence of ~15 batched tensor ops on fused weights (q|k|v and gate|up are one matmul
each, RoPE is applied to q and k together), and everything that is the same for all layers
(positions, slots, gather indices, mask) is computed once per forward in ``PagedBatch``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.engine import attention
from worker.engine.kv_cache import AttnGroup, KVCache, PagedBatch
from worker.engine.linear import bf16_linear, can_bf16, can_pack, pack, pack_bf16, packed_linear
from worker.engine.loader import ModelConfig, fused_weights, load_config, load_state_dict


BF16_MIN_ROWS = 16  # prompt rows beside decode rows that justify reading the bf16 copy too


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[d/2] inverse frequencies with the config's scaling (same formulas as transformers)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    p = dict(cfg.rope_params)
    if cfg.rope_type == "linear":
        return inv / p["factor"]
    if cfg.rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    return inv


class LlamaModel:
    """Weights (see loader.fused_weights):
      embed [V, D], norm [D], head [V, D] (the same tensor as embed when tied), and per layer
      ln1 [D], qkv [(H + 2K) * d, D], qkv_bias [(H + 2K) * d] | None, o [D, H * d], ln2 [D],
      gate_up [2I, D], down [D, I]. On CPU the matrices (head included) are stored either packed
      (``packed``: a model whose weights stay put, see worker/engine/linear.py) or transposed,
      [in, out] (``t_layout``: a draft that the mover offloads as plain tensors).
      ``prefill_bf16`` adds a bf16 copy of each layer's matrices (``wb``) for prompt rows.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device: str | torch.device,
                 packed: bool = False, prefill_bf16: bool = False) -> None:
        """packed: store the matrices packed for worker/engine/linear.py (CPU fp32 only; the model cannot move then).
        prefill_bf16: also keep bf16 copies, and run the rows from ``forward``'s ``prefill_from`` on them."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = weights
        if packed and not can_pack(self.device, dtype):
            raise ValueError(f"packed weights need fp32 on a CPU with oneDNN, not {dtype} on {self.device}")
        self.packed = packed
        if prefill_bf16 and not (packed and can_bf16()):
            raise ValueError("bf16 prefill needs packed fp32 weights on a CPU whose oneDNN has a native bf16 path")
        self.wb = [{k: pack_bf16(layer[k]) for k in ("qkv", "o", "gate_up", "down")}
                   for layer in weights["layers"]] if prefill_bf16 else None
        self.paged_attention = attention.usable(self.device, dtype, cfg.head_dim)
        # Otherwise on CPU, x @ W^T with W^T stored contiguous ([in, out]) beats F.linear on
        # [out, in] at small row counts with MKL; the layout is kept across to_device moves.
        self.t_layout = self.device.type == "cpu" and not packed
        layout = pack if packed else (lambda t: t.t().contiguous()) if self.t_layout else None
        if layout is not None:
            for layer in weights["layers"]:
                for k in ("qkv", "o", "gate_up", "down"):
                    layer[k] = layout(layer[k])
            weights["head"] = layout(weights["head"])  # a tied head gets its own copy
        self.inv_freq = rope_inv_freq(cfg)
        self._rope_len = 0
        self._ensure_rope(2048)

    @classmethod
    def from_folder(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    packed: bool = False, prefill_bf16: bool = False) -> "LlamaModel":
        cfg = load_config(folder)
        return cls(cfg, fused_weights(cfg, load_state_dict(folder), dtype, device), dtype, device, packed, prefill_bf16)

    # ------------------------------------------------------------------ weights residency

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct weight tensor (the tied head counted once)."""
        out = [self.w["embed"], self.w["norm"]]
        if self.w["head"] is not self.w["embed"]:
            out.append(self.w["head"])
        for layer in self.w["layers"]:
            out.extend(t for t in layer.values() if t is not None)
        for layer in self.wb or []:
            out.extend(layer.values())
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to_device(self, device: str | torch.device) -> None:
        """Move every weight (keeps the embed/head tie); used to offload and reload a draft."""
        if self.packed:
            raise RuntimeError("a model with packed weights cannot move; build the moving draft unpacked")
        dev = torch.device(device)
        tied = self.w["head"] is self.w["embed"]
        self.w["embed"] = self.w["embed"].to(dev)
        self.w["norm"] = self.w["norm"].to(dev)
        self.w["head"] = self.w["embed"] if tied else self.w["head"].to(dev)
        for layer in self.w["layers"]:
            for k, t in layer.items():
                if t is not None:
                    layer[k] = t.to(dev)
        self.device = dev
        self.paged_attention = attention.usable(dev, self.dtype, self.cfg.head_dim)
        self._rope_len = 0
        self._ensure_rope(2048)

    # ------------------------------------------------------------------ forward

    def _ensure_rope(self, n: int) -> None:
        if n <= self._rope_len:
            return
        n = max(n, 2 * self._rope_len)
        half = self.cfg.head_dim // 2
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)  # [n, d/2]
        # rotate(x) = x * cos + roll(x, d/2) * sin_signed, roll(x) = [x2, x1] -> sign [-, +]
        self.cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(self.device, self.dtype)  # [n, d]
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(self.device, self.dtype)  # [n, d]
        self._rope_len = n
        self._half = half

    def forward(self, input_ids: torch.Tensor, pb: PagedBatch, kv: KVCache, logit_rows: torch.Tensor,
                prefill_from: int | None = None) -> torch.Tensor:
        """input_ids: [N] new tokens in flat order, prompt tokens (if any) from row ``prefill_from`` on;
        returns float32 logits [R] rows -> [R, V]."""
        c, w = self.cfg, self.w
        n = input_ids.shape[0]
        split = self._bf16_split(n, prefill_from)
        h_, k_, d = c.num_heads, c.num_kv_heads, c.head_dim
        self._ensure_rope(pb.max_position + 1)
        cos = self.cos[pb.positions].unsqueeze(1)  # [N, 1, d]
        sin = self.sin[pb.positions].unsqueeze(1)
        eps = c.rms_norm_eps
        x = w["embed"][input_ids]  # [N, D]
        k_layers, v_layers = kv.k.unbind(0), kv.v.unbind(0)  # one op each instead of one per layer
        for li, lw in enumerate(w["layers"]):
            lb = self.wb[li] if split is not None else {}
            hn = F.rms_norm(x, (x.shape[-1],), lw["ln1"], eps)
            qkv = self._lin(hn, lw["qkv"], lw["qkv_bias"], lb.get("qkv"), split)  # [N, (H + 2K) * d]
            qk = qkv[:, : (h_ + k_) * d].view(n, h_ + k_, d)
            qk = torch.addcmul(qk * cos, torch.roll(qk, self._half, -1), sin)  # RoPE on q and k at once
            vv = qkv[:, (h_ + k_) * d:].view(n, k_, d)
            kc, vc = k_layers[li], v_layers[li]  # [num_blocks, block_size, K, d]
            kc.view(-1, k_, d).index_copy_(0, pb.slots, qk[:, h_:])
            vc.view(-1, k_, d).index_copy_(0, pb.slots, vv)
            qq = qk[:, :h_]  # [N, H, d]
            if len(pb.groups) == 1:
                o = self._attend(pb.groups[0], qq, kc, vc, pb.positions, split)
            else:  # cat promotes a bf16 prompt group's rows to fp32 beside fp32 decode rows
                o = torch.cat([self._attend(g, qq[g.start:g.end], kc, vc, pb.positions, split) for g in pb.groups])
            x = self._lin(o, lw["o"], x, lb.get("o"), split)  # x + o @ Wo in one op
            hn = F.rms_norm(x, (x.shape[-1],), lw["ln2"], eps)
            x = self._mlp(hn, x, lw, lb, split)
        x = F.rms_norm(x.index_select(0, logit_rows), (x.shape[-1],), w["norm"], eps)
        return self._lin(x, w["head"]).float()  # [R, V]

    def _bf16_split(self, n: int, prefill_from: int | None) -> int | None:
        """First row run in bf16, or None for all fp32. Beside decode rows, a few prompt rows cost less
        on the fp32 weights already being read than a second pass over the bf16 copy."""
        if self.wb is None or prefill_from is None or prefill_from >= n:
            return None
        return prefill_from if prefill_from == 0 or n - prefill_from >= BF16_MIN_ROWS else None

    def _lin(self, x: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None,
             wb: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
        """x @ W (+ add: a bias [out] or a residual [N, out], fused into the matmul on CPU); rows from
        ``split`` on use wb, W's bf16 copy."""
        if split is not None:
            if split == 0:
                return bf16_linear(x, wb, add)
            lo, hi = (add, add) if add is None or add.dim() == 1 else (add[:split], add[split:])
            return torch.cat([packed_linear(x[:split], w, lo), bf16_linear(x[split:], wb, hi)])  # [N, out]
        if self.packed:
            return packed_linear(x, w, add)
        if not self.t_layout:
            out = F.linear(x, w)
            return out if add is None else out + add
        return x @ w if add is None else torch.addmm(add, x, w)

    def _mlp(self, hn: torch.Tensor, x: torch.Tensor, lw: dict, lb: dict, split: int | None) -> torch.Tensor:
        """x + down(silu(gate) * up); hn: [N, D] normed x -> [N, D]. Rows from ``split`` on run on the
        bf16 copy and stay bf16 between the two matmuls: down would round its input to bf16 anyway."""
        if split is None:
            gu = self._lin(hn, lw["gate_up"])  # [N, 2I]
            g, u = gu.chunk(2, -1)
            return self._lin(F.silu(g) * u, lw["down"], x)
        gu = bf16_linear(hn[split:], lb["gate_up"], bf16_out=True)  # [N - split, 2I] bf16
        g, u = gu.chunk(2, -1)
        hi = bf16_linear(F.silu(g) * u, lb["down"], x[split:])  # [N - split, D] fp32
        return hi if split == 0 else torch.cat([self._mlp(hn[:split], x[:split], lw, lb, None), hi])

    def _attend(self, g: AttnGroup, qq: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                positions: torch.Tensor, split: int | None = None) -> torch.Tensor:
        """qq: [n, H, d] queries of group g; kc, vc: [num_blocks, block_size, K, d] -> [n, H * d]. A group of
        prompt rows only (from ``split`` on) attends in bf16 and returns bf16, which Wo's bf16 copy reads."""
        h_, k_, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        b, q, t = g.batch, g.q_max, g.t_max
        if self.paged_attention and g.pad_index is None and q <= attention.MAX_RUN:
            return attention.paged_attention(qq, kc, vc, g.gather, positions[g.start:g.end], b, q)
        kg = kc.index_select(0, g.gather).view(b, t, k_, d).transpose(1, 2)  # [B, K, T, d]
        vg = vc.index_select(0, g.gather).view(b, t, k_, d).transpose(1, 2)
        if g.pad_index is not None:
            qq = qq.new_zeros(b * q, h_, d).index_copy_(0, g.pad_index, qq)
        # GQA without repeating K/V: the rep = H/K query heads that share a KV head become
        # extra query rows of that head: [B, Q, K, rep, d] -> [B, K, Q * rep, d]
        rep = h_ // k_
        qq = qq.view(b, q, k_, rep, d).permute(0, 2, 1, 3, 4).reshape(b, k_, q * rep, d)
        if split is not None and g.start >= split:
            qq, kg, vg = qq.to(torch.bfloat16), kg.to(torch.bfloat16), vg.to(torch.bfloat16)
            mask = g.additive_mask(rep, torch.bfloat16)  # the CPU flash kernel runs a 0/-inf mask faster
        else:
            mask = g.mask if rep == 1 else g.mask_rep(rep)  # [B, 1, Q * rep, T]
        o = F.scaled_dot_product_attention(qq, kg, vg, attn_mask=mask)  # [B, K, Q * rep, d]
        o = o.view(b, k_, q, rep, d).permute(0, 2, 1, 3, 4).reshape(b * q, h_ * d)  # [B * Q, H * d]
        if g.pad_index is not None:
            o = o.index_select(0, g.pad_index)  # [n, H * d]
        return o
