"""The oneDNN packed CPU linear path against F.linear, at every row count the engine uses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.engine.linear import can_pack, pack, packed_linear
from worker.engine.model import LlamaModel

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="needs oneDNN on CPU")

# decode (1 row per sequence), verify (γ+1 rows), prefill chunks: 1..512 rows, odd counts included
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 128, 257, 512]


@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 256, generator=gen) / 16  # [out, in]
    x = torch.randn(rows, 256, generator=gen)  # [N, in]
    resid = torch.randn(rows, 384, generator=gen)  # [N, out]
    bias = torch.randn(384, generator=gen)
    wp = pack(w)
    ref = F.linear(x, w)
    tol = 1e-5 * max(1.0, ref.abs().max().item())
    assert (packed_linear(x, wp) - ref).abs().max().item() <= tol
    assert (packed_linear(x, wp, resid) - (ref + resid)).abs().max().item() <= tol
    assert (packed_linear(x, wp, bias) - (ref + bias)).abs().max().item() <= tol


def test_pack_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="fp32 CPU"):
        pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.zeros(4))


def test_packed_model_keeps_weight_bytes_and_refuses_to_move():
    from tests.conftest import random_models

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
