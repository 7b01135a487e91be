"""The C paged-attention kernel against torch's gather + SDPA path it replaces on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker.engine import attention
from worker.engine.kv_cache import build_paged_batch

pytestmark = pytest.mark.skipif(attention.kernel() is None, reason="no C compiler on this machine")


def _reference(q, kc, vc, tables, pos, batch, q_len):
    """Plain causal attention over each sequence's gathered keys: [B * Q, H * d]."""
    n, h, d = q.shape
    _, bs, k, _ = kc.shape
    out = torch.empty(n, h * d)
    mb = tables.numel() // batch
    for b in range(batch):
        rows = slice(b * q_len, (b + 1) * q_len)
        t = int(pos[rows].max()) + 1
        keys = kc[tables[b * mb:(b + 1) * mb]].reshape(-1, k, d)[:t].repeat_interleave(h // k, 1)  # [T, H, d]
        vals = vc[tables[b * mb:(b + 1) * mb]].reshape(-1, k, d)[:t].repeat_interleave(h // k, 1)
        s = torch.einsum("qhd,thd->hqt", q[rows], keys) * d ** -0.5  # [H, Q, T]
        s = s.masked_fill(torch.arange(t) > pos[rows].view(1, -1, 1), float("-inf"))
        out[rows] = torch.einsum("hqt,thd->qhd", s.softmax(-1), vals).reshape(q_len, h * d)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 4, 64), (4, 4, 32), (8, 2, 128), (6, 3, 24)])
@pytest.mark.parametrize("q_len", [1, 4, 16])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_matches_reference(heads, kv_heads, head_dim, q_len, threads):
    gen = torch.Generator().manual_seed(q_len * 100 + heads)
    batch, bs, num_blocks = 5, 8, 64
    kc = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    vc = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    starts = [0, 3, 17, 40, 63]  # a first token, block edges and a long history
    mb = max((s + q_len + bs - 1) // bs for s in starts)
    perm = torch.randperm(num_blocks, generator=gen)[:batch * mb]  # scattered blocks, not in order
    tables = perm.view(batch, mb).contiguous().view(-1)
    pos = torch.tensor([s + i for s in starts for i in range(q_len)])
    # the queries as the model passes them: a strided slice of q|k|v
    qkv = torch.randn(batch * q_len, heads + 2 * kv_heads, head_dim, generator=gen)
    q = qkv[:, :heads]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention.paged_attention(q, kc, vc, tables, pos, batch, q_len)
    finally:
        torch.set_num_threads(old)
    want = _reference(q, kc, vc, tables, pos, batch, q_len)
    assert (got - want).abs().max().item() < 1e-5


def test_model_decode_and_verify_match_the_gather_path(tmp_path):
    from tests.conftest import random_models
    from worker.engine.kv_cache import KVCache
    from worker.engine.model import LlamaModel

    model = LlamaModel.from_folder(random_models()["qwen2"])
    assert model.paged_attention
    c = model.cfg
    gen = torch.Generator().manual_seed(1)
    kv = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 40, torch.float32, "cpu")
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    # a verify group of 3 runs of 4 tokens, then a prefill chunk (SDPA) in the same forward
    starts, q_lens = [5, 30, 12, 0], [4, 4, 4, 20]
    tables = [[3, 9], [1, 2, 4, 5, 6], [7, 8], [10, 11, 12]]
    ids = torch.randint(0, min(c.vocab_size, 256), (sum(q_lens),), generator=gen)
    rows = torch.arange(sum(q_lens))
    k0, v0 = kv.k.clone(), kv.v.clone()
    paged = model.forward(ids, build_paged_batch(starts, q_lens, tables, 8, torch.device("cpu")), kv, rows)
    kv.k.copy_(k0)
    kv.v.copy_(v0)
    model.paged_attention = False
    gathered = model.forward(ids, build_paged_batch(starts, q_lens, tables, 8, torch.device("cpu")), kv, rows)
    assert (paged - gathered).abs().max().item() < 1e-4 * max(1.0, gathered.abs().max().item())


def test_disabled_by_env_falls_back(tmp_path):
    code = ("import torch; from worker.engine import attention; "
            "print(attention.kernel() is None, attention.usable(torch.device('cpu'), torch.float32, 64))")
    env = dict(os.environ, NIGHTJAR_PAGED_ATTENTION="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_builds_into_the_cache_folder_and_reuses_it(tmp_path):
    code = "from worker.engine import attention; print(attention.kernel() is not None)"
    env = dict(os.environ, NIGHTJAR_KERNEL_CACHE=str(tmp_path))
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "True"
    built = list(tmp_path.glob("paged_attention-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.tmp*"))


def test_no_compiler_logs_and_falls_back(tmp_path):
    code = ("import logging, torch; logging.basicConfig(); from worker.engine import attention; "
            "print(attention.kernel() is None)")
    env = dict(os.environ, NIGHTJAR_KERNEL_CACHE=str(tmp_path), CC=str(tmp_path / "no-such-cc"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert "paged_attention kernel unavailable" in out.stderr


def test_portable_build_is_found_without_a_compiler(tmp_path):
    """A prebuilt portable kernel (as the Docker image ships) loads where no compiler is."""
    env = dict(os.environ, NIGHTJAR_KERNEL_CACHE=str(tmp_path), NIGHTJAR_KERNEL_MARCH="x86-64-v3")
    code = "from worker.engine import attention; print(attention.kernel() is not None)"
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64-v3 names an x86 CPU level")
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, CC=str(tmp_path / "no-such-cc"), PATH="/nonexistent"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_out_of_pool_addresses_raise_instead_of_reading_past_the_pool():
    kc = torch.zeros(4, 8, 2, 32)
    q = torch.zeros(2, 4, 32)
    ok_tables, ok_pos = torch.tensor([0, 1, 2, 3]), torch.tensor([15, 3])
    attention.paged_attention(q, kc, kc, ok_tables, ok_pos, 2, 1)
    with pytest.raises(IndexError):  # block id 9 in a pool of 4
        attention.paged_attention(q, kc, kc, torch.tensor([0, 9, 2, 3]), ok_pos, 2, 1)
    with pytest.raises(IndexError):  # position 16 needs a third block of a 2-block table
        attention.paged_attention(q, kc, kc, ok_tables, torch.tensor([16, 3]), 2, 1)
    with pytest.raises(IndexError):
        attention.paged_attention(q, kc, kc, ok_tables, torch.tensor([-1, 3]), 2, 1)
