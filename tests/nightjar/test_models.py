"""The shipped pairs (serve-*, the default; tiny-*, the tests' small one): load offline, share one
tokenizer, have the shapes they promise, and agree as promised."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: no hub, ever

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from nightjar.paths import HELDOUT_PROMPTS, SERVE_DRAFT, SERVE_TARGET, TINY_DRAFT, TINY_TARGET  # noqa: E402
from nightjar_tools.demo import DEFAULT_PROMPT  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import check_acceptance  # noqa: E402

# (target, draft, min greedy agreement on the 8-prompt sample, committed-size budget).
# Agreement measured on 64 prompts x 64 tokens is in models/README.md; the sample here is noisier.
PAIRS = {"serve": (SERVE_TARGET, SERVE_DRAFT, 0.62, 128 * 10**6), "tiny": (TINY_TARGET, TINY_DRAFT, 0.60, 60 * 1024 * 1024)}
FOLDERS = [SERVE_TARGET, SERVE_DRAFT, TINY_TARGET, TINY_DRAFT]
L3_BYTES = 32 * 1024 * 1024  # these machines' last-level cache


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SERVE_TARGET)


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, str]]:
    with HELDOUT_PROMPTS.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_loads_offline_as_llama_in_bf16(folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == 4096
    assert model.config.max_position_embeddings >= 1024
    gen = GenerationConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert gen.eos_token_id == tok.eos_token_id == model.config.eos_token_id == 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}, "store bf16 to keep the committed size small"
    logits = model(input_ids=torch.tensor([tok.encode("def main():\n")])).logits  # [1, n, vocab]
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", PAIRS)
def test_pair_shares_the_vocabulary(name: str) -> None:
    target, draft, _, budget = PAIRS[name]
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    t = json.loads((target / "config.json").read_text())
    d = json.loads((draft / "config.json").read_text())
    assert t["vocab_size"] == d["vocab_size"]
    assert sum(p.stat().st_size for f in (target, draft) for p in f.iterdir()) <= budget


def _params(cfg: dict) -> int:
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (cfg["num_attention_heads"] * cfg["head_dim"]) * 2 + 2 * h * kv + 3 * h * i + 2 * h
    return n * per_layer + v * h * (1 if cfg["tie_word_embeddings"] else 2) + h


def test_serve_pair_is_serving_shaped() -> None:
    # An 8B/1B pair in miniature: a few wide layers whose fp32 weights are >= 4x the L3 (a step
    # streams them), GQA, and a draft whose weights fit in cache.
    t = json.loads((SERVE_TARGET / "config.json").read_text())
    d = json.loads((SERVE_DRAFT / "config.json").read_text())
    assert t["num_hidden_layers"] <= 6 and t["num_key_value_heads"] < t["num_attention_heads"]
    assert _params(t) * 4 >= 4 * L3_BYTES
    model = AutoModelForCausalLM.from_pretrained(SERVE_TARGET, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == _params(t)
    assert _params(d) * 4 < L3_BYTES / 2


def test_tokenizer_is_bos_less_with_eos(tokenizer) -> None:
    assert tokenizer.bos_token is None
    assert tokenizer.eos_token == "<|endoftext|>"
    ids = tokenizer.encode("import os")
    assert ids and ids[0] != tokenizer.eos_token_id and tokenizer.eos_token_id not in ids


def test_prompt_set_is_varied_and_unique(prompts, tokenizer) -> None:
    assert len(prompts) >= 200
    assert len({p["id"] for p in prompts}) == len(prompts)
    lengths = [len(tokenizer.encode(p["text"])) for p in prompts]
    assert min(lengths) >= 4 and max(lengths) <= 420
    assert min(lengths) < 32 and max(lengths) > 256


def test_tokenizer_round_trips_every_prompt_byte_exactly(prompts, tokenizer) -> None:
    for p in prompts:
        text = tokenizer.decode(tokenizer.encode(p["text"]), skip_special_tokens=False)
        assert text.encode("utf-8") == p["text"].encode("utf-8"), p["id"]


def test_the_demo_prompt_ends_where_running_code_would_split_it(tokenizer) -> None:
    # The tokenizer merges a newline with the indentation after it and leaves one space on the
    # next word ("\n   ", " return"), so a prompt ending in its indentation ends on a token the
    # model never saw there, and its greedy continuation is noise.
    indented = tokenizer.encode("def f(n):\n    ")
    assert tokenizer.encode("def f(n):\n    return n")[: len(indented)] != indented
    assert DEFAULT_PROMPT == DEFAULT_PROMPT.rstrip(" \t")
    ids = tokenizer.encode(DEFAULT_PROMPT)
    assert tokenizer.encode(DEFAULT_PROMPT + "\n        return n\n")[: len(ids)] == ids


def test_replay_blocks_counts_leading_matches() -> None:
    # gamma 2 over [T T | F . | T F | T T]: blocks accept 2, 0 (pos 3 skipped as bonus), ...
    matches = [True, True, False, True, True, False, True, True]
    blocks, accepted, reached, acc_at = check_acceptance.replay_blocks(matches, 2)
    # block@0 accepts 2 -> pos 3; block@3 accepts 2 -> pos 6; block@6 accepts 2 -> pos 9 (end)
    assert (blocks, accepted) == (3, 6)
    assert reached == [3, 3] and acc_at == [3, 3]
    blocks, accepted, reached, acc_at = check_acceptance.replay_blocks([False, True, True, False], 3)
    # block@0 accepts 0 -> pos 1; block@1 accepts 2 -> pos 4 (end)
    assert (blocks, accepted, reached, acc_at) == (2, 2, [2, 1, 1], [1, 1, 0])


@pytest.mark.slow  # ~10-30 s of CPU on a quiet machine; minutes when the cores are oversubscribed
@pytest.mark.parametrize("name", PAIRS)
def test_draft_agreement_on_a_sample_meets_the_recipe_threshold(name: str) -> None:
    target, draft, min_agreement, _ = PAIRS[name]
    report = check_acceptance.measure_acceptance(target, draft, HELDOUT_PROMPTS, n_prompts=8, new_tokens=32, seed=0)
    assert report.tokens >= 8
    assert report.agreement >= min_agreement, check_acceptance.format_report(report)
    g1 = report.gammas[0]
    assert abs(g1.mean_accepted - g1.per_position[0]) < 1e-9  # gamma 1: accepted/block == rate
