"""Hugging Face checkpoint folder -> ModelConfig + weight tensors (safetensors only).

Reads config.json (Llama, Mistral and Qwen2 layouts, transformers v4 ``rope_scaling`` and v5
``rope_parameters`` spellings), generation_config.json for EOS ids, and every *.safetensors
shard. Weights are fused at load time (q|k|v into one matrix, gate|up into one) because on a
CPU each separate matmul is a separate Python-level op, and op count is what a tiny model's
decode step costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str  # "default" | "linear" | "llama3"
    rope_params: tuple[tuple[str, float], ...]  # the scaling dict's numeric entries
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x not in out:
                out.append(x)
    return tuple(out)


def load_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a Hugging Face checkpoint folder "
                                "(config.json + *.safetensors)")
    c = _read_json(path)
    mtype = c.get("model_type", "")
    if mtype not in SUPPORTED_TYPES:
        raise ValueError(f"{path}: model_type {mtype!r} is not supported; this engine runs {SUPPORTED_TYPES}")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {c.get('hidden_act')!r} is not supported (only silu / SwiGLU)")
    if mtype == "qwen2" and c.get("use_sliding_window", False):
        raise ValueError(f"{path}: sliding-window attention is not supported; set use_sliding_window=false")
    rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE}")
    theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
    if rope_type == "llama3":
        rp.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 2048))
    heads = int(c["num_attention_heads"])
    gen_eos = None
    if (folder / "generation_config.json").is_file():
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    return ModelConfig(
        model_type=mtype,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_type=rope_type,
        rope_params=tuple(sorted((k, float(v)) for k, v in rp.items()
                                 if k != "rope_theta" and isinstance(v, (int, float)) and not isinstance(v, bool))),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=mtype == "qwen2" or bool(c.get("attention_bias", False)),
        eos_token_ids=_eos_ids(c.get("eos_token_id"), gen_eos),
    )


def load_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (convert .bin checkpoints with safetensors first)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def fused_weights(cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> dict[str, object]:
    """The tensors the model runs on, fused and cast; keys are documented in model.py."""

    def get(name: str) -> torch.Tensor:
        for prefix in ("model.", ""):
            if prefix + name in sd:
                return sd[prefix + name]
        raise KeyError(f"checkpoint is missing weight {name!r}")

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        qkv = torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")])
        bias = None
        if cfg.qkv_bias:
            bias = put(torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]))
        m = p + "mlp."
        layers.append(
            {
                "ln1": put(get(p + "input_layernorm.weight")),
                "qkv": put(qkv),
                "qkv_bias": bias,
                "o": put(get(a + "o_proj.weight")),
                "ln2": put(get(p + "post_attention_layernorm.weight")),
                "gate_up": put(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])),
                "down": put(get(m + "down_proj.weight")),
            }
        )
    embed = put(get("embed_tokens.weight"))
    if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
        head = embed
    else:
        head = put(sd["lm_head.weight"])
    return {"embed": embed, "norm": put(get("norm.weight")), "head": head, "layers": layers}
