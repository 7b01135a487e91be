"""scripts/widen_model.py: a heavier target for benchmarks that computes exactly what the original does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from widen_model import widen

from tests.conftest import hf_model, random_models


def test_widened_model_has_the_cost_of_a_wider_mlp_and_the_same_logits(tmp_path):
    src = random_models()["llama-target"]
    dst = widen(src, tmp_path / "wide", factor=3)
    before = json.loads((src / "config.json").read_text())["intermediate_size"]
    assert json.loads((dst / "config.json").read_text())["intermediate_size"] == 3 * before
    state = load_file(str(dst / "model.safetensors"))
    gate = state["model.layers.0.mlp.gate_proj.weight"]  # [3I, H]
    down = state["model.layers.0.mlp.down_proj.weight"]  # [H, 3I]
    assert gate.shape[0] == 3 * before and down.shape[1] == 3 * before
    assert gate[before:].abs().min() > 0  # dense new rows: a GEMM does the full work
    assert torch.count_nonzero(down[:, before:]) == 0  # ... and writes nothing back

    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_model(str(src))(ids).logits  # [2, 24, V]
        wide = type(hf_model(str(src))).from_pretrained(str(dst), dtype=torch.float32).eval()
        got = wide(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_widen_refuses_what_it_cannot_keep_exact(tmp_path):
    models = random_models()
    with pytest.raises(ValueError, match="factor"):
        widen(models["llama-target"], tmp_path / "a", factor=0)
    with pytest.raises(ValueError, match="Llama"):
        widen(models["qwen2"], tmp_path / "b", factor=2)
