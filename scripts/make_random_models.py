"""Random-weight Hugging Face checkpoints for tests (never committed; tests build them in a tmp dir).

    .venv/bin/python scripts/make_random_models.py OUT_DIR

writes OUT_DIR/llama-target, OUT_DIR/llama-draft (a Llama pair sharing a byte-level tokenizer;
the target uses llama3 rope scaling and an untied head, the draft linear scaling and a tied head)
and OUT_DIR/qwen2 (a Qwen2-style config with GQA and q/k/v bias), with weights of a large spread
so that logits are well separated and greedy comparisons are not dominated by near-ties.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

VOCAB = 260  # 256 byte tokens + specials + spare rows


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def _spread_init(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                else:  # biases
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def _save(model, tokenizer, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_all(out_dir: str | Path) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tok = make_tokenizer()
    eos = tok.eos_token_id
    common = dict(vocab_size=VOCAB, bos_token_id=eos, eos_token_id=eos, max_position_embeddings=1024,
                  rms_norm_eps=1e-5)
    target = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64}, **common)
    draft = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, **common)
    qwen = Qwen2Config(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
                       num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)
    paths = {}
    for name, cfg, cls, seed in (("llama-target", target, LlamaForCausalLM, 1), ("llama-draft", draft, LlamaForCausalLM, 2),
                                 ("qwen2", qwen, Qwen2ForCausalLM, 3)):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        _spread_init(model, seed)
        paths[name] = _save(model, tok, out_dir / name)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    for name, path in make_all(sys.argv[1]).items():
        print(f"{name}: {path}")
