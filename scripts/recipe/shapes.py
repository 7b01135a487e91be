"""The architectures of the shipped pair, as Llama configs.

Why this shape (measured with scripts/train_models.py shapes; see models/README.md): at batch 1
on a CPU a decode step is dominated by per-layer overhead, not by FLOPs, so the target/draft
cost ratio comes from depth, not width. The target is deep and narrow (12 layers, width 256);
the draft is one layer of the same width, so it can start from the target's embedding, first
layer and head and only has to learn to imitate the other eleven.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig

VOCAB_SIZE = 4096
MAX_POSITIONS = 1024
EOS_ID = 0


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    tied: bool

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: hidden % heads and heads % kv_heads must be 0")

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads,
            max_position_embeddings=MAX_POSITIONS,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            hidden_act="silu",
            tie_word_embeddings=self.tied,
            attention_bias=False,
            mlp_bias=False,
            bos_token_id=None,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
            initializer_range=0.02,
        )


# GQA in the target (8 query heads, 4 KV heads) so the engine's GQA path runs on a real model;
# tied head in the target, untied in the draft, so both head layouts are exercised.
TARGET = ModelShape("tiny-target", layers=12, hidden=256, intermediate=768, heads=8, kv_heads=4, tied=True)
DRAFT = ModelShape("tiny-draft", layers=1, hidden=256, intermediate=768, heads=8, kv_heads=4, tied=False)

# The serving pair: an 8B/1B deployment in miniature. The target is few layers and wide (so a
# step streams its weights instead of paying per-op overhead) and its fp32 weights are over 4x
# the 32 MiB L3 of these machines; the draft is the tiny one-layer shape (its weights fit in
# cache), so one draft step costs a small fraction of a target step, as a 1B draft of an 8B does.
SERVE_TARGET = ModelShape("serve-target", layers=4, hidden=768, intermediate=3072, heads=12, kv_heads=4, tied=True)
SERVE_DRAFT = ModelShape("serve-draft", layers=1, hidden=256, intermediate=768, heads=8, kv_heads=4, tied=False)
SHAPES = {s.name: s for s in (TARGET, DRAFT, SERVE_TARGET, SERVE_DRAFT)}

CANDIDATES = {
    "t6x384": ModelShape("t6x384", 6, 384, 1024, 6, 6, True),
    "t12x256": TARGET,
    "t12x384": ModelShape("t12x384", 12, 384, 1024, 6, 3, True),
    "t10x320": ModelShape("t10x320", 10, 320, 896, 8, 4, True),
    "d2x192": ModelShape("d2x192", 2, 192, 512, 4, 4, False),
    "d1x256": DRAFT,
    "d1x192": ModelShape("d1x192", 1, 192, 512, 4, 4, False),
}
