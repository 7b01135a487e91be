"""Our Llama-family forward pass against transformers' own model, through the paged cache.

Tolerance: max |logit difference| <= 1e-4 x max(1, max |reference logit|) in float32 — the
two implementations order float reductions differently (fused q|k|v, chunked prefill over
paged blocks), nothing more.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import SHIPPED_DRAFT, SHIPPED_TARGET, hf_model, random_models, shipped_available
from worker.engine.kv_cache import KVCache, build_paged_batch
from worker.engine.loader import load_config
from worker.engine.model import LlamaModel

RTOL = 1e-4


def _cases() -> list:
    cases = [pytest.param("random:qwen2", id="qwen2-gqa-bias"), pytest.param("random:llama-target", id="llama3-rope-untied"),
             pytest.param("random:llama-draft", id="linear-rope-tied")]
    if shipped_available():
        cases += [pytest.param(str(SHIPPED_TARGET), id="shipped-target"), pytest.param(str(SHIPPED_DRAFT), id="shipped-draft")]
    return cases


def _path(case: str) -> str:
    return str(random_models()[case.split(":", 1)[1]]) if case.startswith("random:") else case


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("case", _cases())
def test_logits_match_transformers(case, packed):
    path = _path(case)
    ours = LlamaModel.from_folder(path, packed=packed)
    ref_model = hf_model(path)
    c = ours.cfg
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(c.vocab_size, 256), (2, 37), generator=gen)  # [2, 37]
    with torch.inference_mode():
        ref = ref_model(ids).logits.float()  # [2, 37, V]
        kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, "cpu")
        # seq 0 in one prefill; seq 1 as a 20-token chunk in the same ragged batch, then a
        # 9-token chunk, then 8 single-token decode steps -> every addressing path is covered
        pb = build_paged_batch([0, 0], [37, 20], [[0, 1, 2, 3, 4], [5, 6, 7]], 8, torch.device("cpu"))
        got = ours.forward(torch.cat([ids[0], ids[1, :20]]), pb, kv, torch.arange(57))
        pieces = [got[37:]]
        table = [5, 6, 7, 8, 9]
        pb = build_paged_batch([20], [9], [table], 8, torch.device("cpu"))
        pieces.append(ours.forward(ids[1, 20:29], pb, kv, torch.arange(9)))
        for pos in range(29, 37):
            pb = build_paged_batch([pos], [1], [table], 8, torch.device("cpu"))
            pieces.append(ours.forward(ids[1, pos:pos + 1], pb, kv, torch.arange(1)))
    scale = max(1.0, ref.abs().max().item())
    err0 = (got[:37] - ref[0]).abs().max().item()
    err1 = (torch.cat(pieces) - ref[1]).abs().max().item()
    assert err0 <= RTOL * scale, f"prefill logits differ by {err0}"
    assert err1 <= RTOL * scale, f"chunked/decode logits differ by {err1}"


def test_config_accepts_v4_rope_scaling_spelling(tmp_path):
    src = random_models()["llama-target"]
    cfg = json.loads((src / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_config(tmp_path) == load_config(src)


def test_config_rejects_unsupported_rope(tmp_path):
    cfg = json.loads((random_models()["qwen2"] / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        load_config(tmp_path)


def test_additive_mask_attends_like_the_boolean_one():
    import torch.nn.functional as F

    # a decode run, then two ragged runs in one padded group: [B=2, 1, Q * rep, T] with rep = 3
    g = build_paged_batch([0, 0, 5], [1, 12, 7], [[4], [0, 1], [2, 3]], 8, torch.device("cpu")).groups[-1]
    assert g.batch == 2 and g.pad_index is not None
    want_mask = g.mask_rep(3)
    add = g.additive_mask(3, torch.float32)
    assert add.shape == want_mask.shape and (add[want_mask] == 0).all() and torch.isneginf(add[~want_mask]).all()
    assert g.additive_mask(3, torch.float32) is add  # built once per forward
    assert g.additive_mask(3, torch.bfloat16).dtype == torch.bfloat16  # not the fp32 one it holds
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, add.shape[2] if i == 0 else add.shape[3], 16, generator=gen) for i in range(3))
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=add)
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v, attn_mask=want_mask), atol=1e-6)
