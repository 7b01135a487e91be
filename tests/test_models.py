"""The shipped target/draft pair: loads offline, shares one tokenizer, and agrees as promised."""

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

from nightjar.paths import DEFAULT_DRAFT, DEFAULT_TARGET, HELDOUT_PROMPTS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_acceptance  # noqa: E402

# Measured on 64 prompts x 64 tokens (models/README.md); the 8-prompt sample here is noisier.
MIN_AGREEMENT = 0.60
MAX_COMMITTED_BYTES = 60 * 1024 * 1024


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, str]]:
    with HELDOUT_PROMPTS.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("folder", [DEFAULT_TARGET, DEFAULT_DRAFT], ids=["target", "draft"])
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


def test_pair_shares_the_vocabulary_and_target_is_deeper() -> None:
    assert (DEFAULT_TARGET / "tokenizer.json").read_bytes() == (DEFAULT_DRAFT / "tokenizer.json").read_bytes()
    t = json.loads((DEFAULT_TARGET / "config.json").read_text())
    d = json.loads((DEFAULT_DRAFT / "config.json").read_text())
    assert t["vocab_size"] == d["vocab_size"]
    assert t["num_hidden_layers"] >= 10 * d["num_hidden_layers"]


def test_committed_size_within_budget() -> None:
    total = sum(p.stat().st_size for d in (DEFAULT_TARGET, DEFAULT_DRAFT) for p in d.iterdir())
    assert total <= MAX_COMMITTED_BYTES


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


@pytest.mark.slow  # ~10 s of CPU on a quiet machine; minutes when the cores are oversubscribed
def test_draft_agreement_on_a_sample_meets_the_recipe_threshold() -> None:
    report = check_acceptance.measure_acceptance(DEFAULT_TARGET, DEFAULT_DRAFT, HELDOUT_PROMPTS,
                                                 n_prompts=8, new_tokens=32, seed=0)
    assert report.tokens >= 8
    assert report.agreement >= MIN_AGREEMENT, check_acceptance.format_report(report)
    g1 = report.gammas[0]
    assert abs(g1.mean_accepted - g1.per_position[0]) < 1e-9  # gamma 1: accepted/block == rate
