"""`nightjar serve MODEL`: model resolution (folder, hub id from a local cache the test builds),
the pre-start checks (one line each), the served context, the pass-through flags, --version."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nightjar import paths
from nightjar_tools.model_check import check
from nightjar_tools.serve import add_stack_args, stack_config
from nightjar_tools.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
TARGET, DRAFT = paths.DEFAULT_TARGET, paths.DEFAULT_DRAFT


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar serve")
    p.add_argument("model_arg", nargs="?", default=None)
    add_stack_args(p, port=50051, http_port=8000)
    return p


def config(argv: list[str], tmp_path: Path):
    p = serve_parser()
    return stack_config(p.parse_args(argv), p, log_dir=tmp_path)


def refused(argv: list[str], tmp_path: Path, capsys) -> str:
    """The error line of a refused command line (and that it is exactly one line)."""
    with pytest.raises(SystemExit) as exc:
        config(argv, tmp_path)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nightjar serve: error: "), err
    return err


def copy_model(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_model_folder_alone_serves_without_a_draft(tmp_path):
    cfg = config([str(TARGET)], tmp_path)
    assert cfg.target_path == TARGET.resolve() and cfg.draft_path is None and cfg.default_gamma == 0
    cfg = config(["--model", str(TARGET), "--draft", str(DRAFT)], tmp_path)
    assert cfg.draft_path == DRAFT.resolve()


def test_no_model_serves_the_shipped_pair(tmp_path):
    cfg = config([], tmp_path)
    assert (cfg.target_path, cfg.draft_path, cfg.http_port) == (TARGET, DRAFT, 8000)


def test_target_is_a_deprecated_alias_that_no_longer_implies_the_draft(tmp_path, capsys):
    cfg = config(["--target", str(TARGET)], tmp_path)
    assert cfg.draft_path is None and "deprecated" in capsys.readouterr().err


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-target"
    commit = "0123456789abcdef0123456789abcdef01234567"
    copy_model(TARGET, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cfg = config(["acme/tiny-target"], tmp_path)
    assert cfg.target_path == repo / "snapshots" / commit and cfg.served_model_name == "acme/tiny-target"
    stack = Stack(cfg)
    assert stack._gateway_limits()[-2:] == ["--served-model-name", "acme/tiny-target"]
    # the workers label their metrics with the same name (the snapshot folder's is a commit hash)
    assert stack._worker_limits()[-2:] == ["--served-model-name", "acme/tiny-target"]


def test_hub_id_missing_from_the_cache_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    err = refused(["acme/absent"], tmp_path, capsys)
    assert "hf download acme/absent" in err and str(tmp_path / "empty") in err


def test_unsupported_model_type_is_one_line(tmp_path, capsys):
    model = copy_model(TARGET, tmp_path / "gpt", model_type="gpt2")
    assert "model_type 'gpt2' is not supported" in refused([str(model)], tmp_path, capsys)


def test_draft_with_another_tokenizer_is_one_line(tmp_path, capsys):
    draft = copy_model(DRAFT, tmp_path / "other-draft")
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, different ids
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    err = refused([str(TARGET), "--draft", str(draft)], tmp_path, capsys)
    assert "do not share a tokenizer" in err


def test_the_advertised_context_is_the_engines_real_one(tmp_path):
    """Min of target, draft and the KV cache: checked against a real engine's own figure."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    max_pos = json.loads((TARGET / "config.json").read_text())["max_position_embeddings"]
    short_draft = copy_model(DRAFT, tmp_path / "short-draft", max_position_embeddings=max_pos // 2)
    assert check(TARGET, short_draft).context_tokens == max_pos // 2
    small_kv = 40 * 16 * 2 * 4 * 32 * 4 * 13  # about 40 blocks of target (12 layers) + draft (1 layer)
    served = check(TARGET, DRAFT, kv_cache_bytes=small_kv)
    assert served.context_tokens < max_pos and "KV" in served.why
    engine = Engine(EngineConfig(str(TARGET), str(DRAFT), kv_budget_bytes=small_kv))
    assert engine.max_context_tokens == served.context_tokens
    cfg = config([str(TARGET), "--draft", str(DRAFT), "--kv-cache-memory-bytes", str(small_kv), "--gamma-max", "6"], tmp_path)
    assert cfg.context_tokens == served.context_tokens


def test_max_model_len_over_the_real_context_is_one_line(tmp_path, capsys):
    err = refused([str(TARGET), "--max-model-len", "100000"], tmp_path, capsys)
    assert "exceeds the engine's context" in err
    assert "--max-num-seqs" in refused([str(TARGET), "--max-num-seqs", "500"], tmp_path, capsys)


def test_pass_through_flags_reach_the_services(tmp_path):
    cfg = config([str(TARGET), "--max-model-len", "512", "--max-num-seqs", "8", "--gamma-max", "4",
                  "--kv-cache-memory-bytes", str(64 << 20), "--api-key", "s3cret", "--http-port", "0"], tmp_path)
    stack = Stack(cfg)
    worker = stack._worker_limits()
    assert worker[:8] == ["--max-model-len", "512", "--max-running", "8", "--kv-budget-bytes", str(64 << 20),
                          "--gamma-max", "4"]
    gateway = stack._gateway_limits()
    assert gateway[:6] == ["--max-context-tokens", "512", "--max-tokens-limit", "511", "--default-max-tokens", "64"]
    assert stack._planner_args()[:4] == ["--policy", "nightjar", "--gamma-max", "4"]  # the planner obeys it too
    deeper = Stack(config([str(TARGET), "--gamma-max", "6", "--policy", "fixed:6"], tmp_path))
    assert deeper._planner_args()[:4] == ["--policy", "fixed:6", "--gamma-max", "6"]
    assert cfg.api_key == "s3cret" and "s3cret" not in repr(cfg) and cfg.http_port == 0
    assert "s3cret" not in " ".join(worker + gateway)


def test_version_and_serve_help():
    out = subprocess.run([sys.executable, "-m", "nightjar_tools.cli", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("nightjar ") and out.stdout.split()[1][0].isdigit()
    out = subprocess.run([sys.executable, "-m", "nightjar_tools.cli", "serve", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "MODEL" in out.stdout and "--http-port" in out.stdout and "--api-key" in out.stdout
