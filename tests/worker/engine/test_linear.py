"""The packed CPU linear paths (panel kernel, oneDNN) against F.linear, at every row count the engine uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import random_models
from worker.engine import linear
from worker.engine.linear import can_pack, pack, packed_linear
from worker.engine.model import BF16_MIN_ROWS, LlamaModel
from worker.engine.runner import ModelRunner, Run

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="needs oneDNN on CPU")

# decode (1 row per sequence), verify (γ+1 rows), prefill chunks: 1..512 rows, odd counts included;
# every tail of the kernel's 6- and 12-row tiles
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 15, 16, 17, 22, 31, 33, 64, 100, 128, 257, 512]


KINDS = ["onednn", pytest.param("panel", marks=pytest.mark.skipif(linear.kernel() is None, reason="no C compiler"))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_linear_matches_f_linear(rows, kind, threads):
    gen = torch.Generator().manual_seed(rows)
    # [out, in]: an odd K exercises the kernel's k tail, 25 panels its odd last panel
    w = torch.randn(400, 257, generator=gen) / 16
    x = torch.randn(rows, 257, generator=gen)  # [N, in]
    resid = torch.randn(rows, 400, generator=gen)  # [N, out]
    bias = torch.randn(400, generator=gen)
    wp = pack(w, kind)
    assert wp.dim() == (3 if kind == "panel" else 2) and wp.numel() == w.numel()
    ref = F.linear(x, w)
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert (packed_linear(x, wp) - ref).abs().max().item() <= tol
        assert (packed_linear(x, wp, resid) - (ref + resid)).abs().max().item() <= tol
        assert (packed_linear(x, wp, bias) - (ref + bias)).abs().max().item() <= tol
        assert (packed_linear(x[:, :].t().contiguous().t(), wp) - ref).abs().max().item() <= tol  # a strided x
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(linear.kernel() is None, reason="no C compiler")
@pytest.mark.parametrize("rows", [8, 173, 300])
def test_the_panel_kernel_matches_across_row_blocks(rows):
    # K = 3000: the kernel passes over the weights once per 2 MiB of x (168 rows with AVX-512), so 173
    # and 300 rows span two blocks; built for AVX-512 it copies each block's rows into tiles, the last
    # one partial (8 rows: one partial tile)
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 3000, generator=gen) / 64
    x = torch.randn(rows, 3000, generator=gen)
    ref = F.linear(x, w)
    assert (packed_linear(x, pack(w, "panel")) - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.skipif(linear.kernel() is None, reason="no C compiler")
def test_auto_packs_panels_where_the_kernel_takes_the_shape_and_onednn_elsewhere():
    assert pack(torch.randn(32, 8)).dim() == 3
    assert pack(torch.randn(24, 8)).dim() == 2  # 24 is not a whole number of 16-column panels
    with pytest.raises(ValueError, match="out % 16"):
        pack(torch.randn(24, 8), "panel")
    wp = pack(torch.randn(32, 8))
    with pytest.raises(ValueError, match="features"):
        packed_linear(torch.randn(2, 9), wp)
    with pytest.raises(ValueError, match="add of shape"):
        packed_linear(torch.randn(2, 8), wp, torch.randn(3, 32))
    assert packed_linear(torch.randn(0, 8), wp).shape == (0, 32)


def test_the_panel_kernel_can_be_switched_off_and_then_onednn_packs_everything(tmp_path):
    code = ("import torch; from worker.engine import linear; "
            "print(linear.kernel() is None, linear.pack(torch.randn(32, 8)).dim())")
    env = dict(os.environ, NIGHTJAR_PANEL_LINEAR="0", NIGHTJAR_KERNEL_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.split() == ["True", "2"]


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="fp32 CPU"):
        pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.zeros(4))
    with pytest.raises(ValueError, match="kind"):
        pack(torch.zeros(16, 4), "mkl")


def test_packed_model_keeps_weight_bytes_and_refuses_to_move():
    path = random_models()["llama-target"]
    plain, packed = LlamaModel.from_folder(path), LlamaModel.from_folder(path, packed=True)
    assert packed.weight_bytes == plain.weight_bytes > 0
    with pytest.raises(RuntimeError, match="cannot move"):
        packed.to_device("cpu")
    with pytest.raises(ValueError, match="fp32"):
        LlamaModel.from_folder(path, dtype=torch.bfloat16, packed=True)


def test_row_counts_are_bucketed_with_little_waste():
    from worker.engine.linear import padded_rows

    sizes = [padded_rows(n) for n in range(1, 513)]
    assert sizes[:16] == list(range(1, 17))  # decode and verify row counts run exactly
    assert all(n <= p <= n + n / 8 for n, p in enumerate(sizes, 1))  # at most 1/8 of the rows wasted
    assert sizes == sorted(sizes) and len(set(sizes)) <= 64  # few kernels compiled, for good


BF16 = pytest.mark.skipif(not linear.can_bf16(), reason="oneDNN has no native bf16 path on this CPU")


@BF16
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 100, 257, 512])
def test_bf16_linear_differs_from_f_linear_only_by_bf16_rounding(rows):
    torch.manual_seed(rows)
    w = torch.randn(96, 64) * 0.1
    x = torch.randn(rows, 64)
    resid, bias = torch.randn(rows, 96) * 100, torch.randn(96) * 100
    wb = linear.pack_bf16(w)
    ref = F.linear(x.bfloat16().float(), w.bfloat16().float())  # fp32 product of the rounded inputs
    tol = 2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max()  # [N, 96]: the product rounded once to bf16
    assert ((linear.bf16_linear(x, wb) - ref).abs() <= tol).all()
    # a residual or bias is added after, in fp32: rounding it (|add| ~ 100) would cost far more than tol
    assert ((linear.bf16_linear(x, wb, resid) - (ref + resid)).abs() <= tol + 1e-5 * resid.abs()).all()
    assert ((linear.bf16_linear(x, wb, bias) - (ref + bias)).abs() <= tol + 1e-5 * bias.abs()).all()
    assert (linear.bf16_linear(x, wb) - F.linear(x, w)).abs().max().item() > 0  # it did round
    kept = linear.bf16_linear(x, wb, bf16_out=True)  # the product as oneDNN rounded it, for a next bf16 op
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), linear.bf16_linear(x, wb))
    assert torch.equal(linear.bf16_linear(x.bfloat16(), wb), linear.bf16_linear(x, wb))  # bf16 input: no cast
    with pytest.raises(ValueError, match="bf16_out"):
        linear.bf16_linear(x, wb, resid, bf16_out=True)


@BF16
def test_bf16_prefill_runs_only_the_prompt_rows_in_bf16():
    path = random_models()["llama-target"]
    fp32 = LlamaModel.from_folder(path, packed=True)
    bf16 = LlamaModel.from_folder(path, packed=True, prefill_bf16=True)
    assert bf16.weight_bytes > fp32.weight_bytes  # the bf16 copy is counted
    torch.manual_seed(0)
    vocab = fp32.cfg.vocab_size

    def logits(model, prompt_len):
        runner = ModelRunner(model, 16, 16, 0.0)
        decode = [Run(torch.randint(vocab, (9,)).tolist(), 0, [0], 3), Run(torch.randint(vocab, (9,)).tolist(), 0, [1], 3)]
        prompt = Run(torch.randint(vocab, (prompt_len,)).tolist(), 0, list(range(2, 2 + -(-prompt_len // 16))), 1,
                     prompt=True)
        return runner.forward(decode + [prompt])  # [7, V]: 3 + 3 decode rows, then the prompt's last

    for prompt_len, prompt_rounded in ((40, True), (BF16_MIN_ROWS - 1, False)):
        torch.manual_seed(prompt_len)
        want = logits(fp32, prompt_len)
        torch.manual_seed(prompt_len)
        got = logits(bf16, prompt_len)
        tol = 1e-4 * max(1.0, want.abs().max().item())
        assert (got[:6] - want[:6]).abs().max().item() <= tol  # decode rows: the fp32 path, untouched
        diff = (got[6] - want[6]).abs().max().item()
        assert (diff > tol) == prompt_rounded  # a few prompt rows beside decode rows stay on the fp32 weights
        assert diff <= 0.05 * max(1.0, want.abs().max().item())
    # a prompt-only step of two ragged prompts (one padded attention group): all bf16, attention included
    runs = [Run(torch.randint(vocab, (n,)).tolist(), 0, list(range(i * 4, i * 4 + 4)), 1, prompt=True)
            for i, n in enumerate((40, 23))]
    want, got = (ModelRunner(m, 16, 16, 0.0).forward(runs) for m in (fp32, bf16))  # [2, V]
    scale = max(1.0, want.abs().max().item())
    assert 1e-4 * scale < (got - want).abs().max().item() <= 0.05 * scale
    with pytest.raises(ValueError, match="decode run after a prompt run"):
        ModelRunner(bf16, 4, 16, 0.0).forward([Run([1, 2], 0, [0], 1, prompt=True), Run([3], 0, [1], 1)])
