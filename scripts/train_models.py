"""Train and export the target/draft pair (the recipe; see models/README.md for the figures).

    .venv/bin/python scripts/train_tokenizer.py --out runs/tokenizer
    nice -n 10 .venv/bin/python scripts/train_models.py all --target-minutes 40 --draft-minutes 18

Subcommands: prompts (held-out prompt set), shapes (decode-time ratio of candidate shapes with
random weights), target (LM training), draft (distillation from the target), export (bf16 Hugging
Face folders), all (prompts, target, draft, export). Checkpoints and logs go to runs/ (git-ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from recipe.corpus import CorpusSpec  # noqa: E402
from recipe.dataset import load_streams  # noqa: E402
from recipe.prompts import build_prompts, write_prompts  # noqa: E402
from recipe.shapes import CANDIDATES, EOS_ID, SHAPES  # noqa: E402
from recipe.timing import decode_ms  # noqa: E402
from recipe.trainer import TrainSpec, distill, heldout_loss, init_draft_from_target, train_lm  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import GenerationConfig, LlamaForCausalLM  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _logger(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        with path.open("a") as f:
            f.write(line + "\n")
    return log


def cmd_prompts(a: argparse.Namespace) -> int:
    tok = Tokenizer.from_file(str(a.tokenizer / "tokenizer.json"))
    prompts = build_prompts(tok, CorpusSpec(root=a.stdlib, seed=a.seed), count=a.count)
    write_prompts(prompts, a.out)
    print(f"{len(prompts)} prompts -> {a.out}")
    return 0


def cmd_shapes(a: argparse.Namespace) -> int:
    torch.manual_seed(a.seed)
    models = {k: LlamaForCausalLM(s.config()).eval() for k, s in CANDIDATES.items()}
    ms = decode_ms(models, rounds=a.rounds)
    base = ms["d1x256"] if "d1x256" in ms else min(ms.values())
    print("| shape | layers | width | params (M) | decode ms/token | ratio to tiny-draft |")
    print("|---|---|---|---|---|---|")
    for k, s in CANDIDATES.items():
        n = sum(p.numel() for p in models[k].parameters()) / 1e6
        print(f"| {k} | {s.layers} | {s.hidden} | {n:.2f} | {ms[k]:.2f} | {ms[k] / base:.2f} |")
    return 0


def _spec(a: argparse.Namespace, minutes: float, tokens: int, lr: float) -> TrainSpec:
    return TrainSpec(tokens=tokens, minutes=minutes, seq_len=a.seq_len, batch=a.batch, lr=lr, seed=a.seed)


def cmd_target(a: argparse.Namespace) -> int:
    log = _logger(a.runs / "target.log")
    train, heldout = load_streams(a.tokenizer, CorpusSpec(root=a.stdlib, seed=a.seed), a.runs / "data")
    log(f"streams: train {train.numel()} tokens, heldout {heldout.numel()} tokens")
    torch.manual_seed(a.seed)
    seen = 0
    if a.init_target is not None:  # continue an earlier run (e.g. when the machine is quieter)
        model = LlamaForCausalLM.from_pretrained(a.init_target, dtype=torch.float32)
        prior = json.loads((a.init_target / "train_stats.json").read_text())
        seen = int(prior.get("tokens_total", prior["tokens"]))
        log(f"continuing from {a.init_target} ({seen} tokens seen)")
    else:
        model = LlamaForCausalLM(SHAPES[a.target_shape].config())
    teacher = None
    if a.teacher is not None:
        teacher = LlamaForCausalLM.from_pretrained(a.teacher, dtype=torch.float32)
        log(f"distilling from teacher {a.teacher} as well as the text")
    spec = _spec(a, a.target_minutes, a.target_tokens, a.target_lr)
    # A continuation samples fresh windows: the same seed would replay the earlier run's batches.
    spec = dataclasses.replace(spec, seed=a.seed + seen)
    stats = train_lm(model, train, spec, log, teacher=teacher)
    stats["tokens_total"] = seen + stats["tokens"]
    stats["heldout_loss"] = heldout_loss(model, heldout)
    log(f"target done: {json.dumps(stats)}")
    model.save_pretrained(a.runs / "target")
    (a.runs / "target" / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return 0


def cmd_draft(a: argparse.Namespace) -> int:
    log = _logger(a.runs / "draft.log")
    train, heldout = load_streams(a.tokenizer, CorpusSpec(root=a.stdlib, seed=a.seed), a.runs / "data")
    target = LlamaForCausalLM.from_pretrained(a.runs / "target", dtype=torch.float32)
    torch.manual_seed(a.seed + 1)
    if a.init_draft is not None:  # e.g. a draft of another target with the same tokenizer
        draft = LlamaForCausalLM.from_pretrained(a.init_draft, dtype=torch.float32)
        log(f"draft starts from {a.init_draft}")
    else:
        draft = LlamaForCausalLM(SHAPES[a.draft_shape].config())
        init_draft_from_target(draft, target)
    spec = TrainSpec(tokens=a.draft_tokens, minutes=a.draft_minutes, seq_len=a.seq_len, batch=a.batch,
                     lr=a.draft_lr, seed=a.seed + 1)
    stats = distill(draft, target, train, spec, log)
    stats["heldout_loss"] = heldout_loss(draft, heldout)
    log(f"draft done: {json.dumps(stats)}")
    draft.save_pretrained(a.runs / "draft")
    (a.runs / "draft" / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return 0


def export(src: Path, dst: Path, tokenizer: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    if dst.exists():
        shutil.rmtree(dst)
    # bf16 halves the committed size; the engine upcasts to fp32 for compute on CPU.
    model.to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    GenerationConfig(bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False,
                     max_length=model.config.max_position_embeddings).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, dst / name)
    if (src / "train_stats.json").exists():
        shutil.copy(src / "train_stats.json", dst / "train_stats.json")


def cmd_export(a: argparse.Namespace) -> int:
    export(a.runs / "target", a.models / a.target_shape, a.tokenizer)
    export(a.runs / "draft", a.models / a.draft_shape, a.tokenizer)
    print(f"exported to {a.models / a.target_shape} and {a.models / a.draft_shape}")
    return 0


def cmd_all(a: argparse.Namespace) -> int:
    for cmd in (cmd_prompts, cmd_target, cmd_draft, cmd_export):
        if cmd(a):
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["prompts", "shapes", "target", "draft", "export", "all"])
    ap.add_argument("--tokenizer", type=Path, default=root / "runs" / "tokenizer")
    ap.add_argument("--runs", type=Path, default=root / "runs", help="checkpoints, logs, token cache")
    ap.add_argument("--models", type=Path, default=root / "models", help="where export writes")
    ap.add_argument("--out", type=Path, default=root / "models" / "prompts.jsonl", help="prompt file")
    ap.add_argument("--stdlib", type=Path, default=CorpusSpec.root)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--count", type=int, default=300, help="held-out prompts")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-minutes", type=float, default=40.0)
    ap.add_argument("--target-tokens", type=int, default=20_000_000)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--init-target", type=Path, default=None, help="target: start from this checkpoint")
    ap.add_argument("--target-shape", choices=sorted(SHAPES), default="serve-target",
                    help="target architecture (recipe/shapes.py); also the exported folder's name")
    ap.add_argument("--draft-shape", choices=sorted(SHAPES), default="serve-draft",
                    help="draft architecture; also the exported folder's name")
    ap.add_argument("--teacher", type=Path, default=None,
                    help="target: also distil from this model folder (same tokenizer), e.g. models/tiny-target")
    ap.add_argument("--init-draft", type=Path, default=None,
                    help="draft: start from this model folder instead of the target's first layer")
    ap.add_argument("--draft-minutes", type=float, default=18.0)
    ap.add_argument("--draft-tokens", type=int, default=20_000_000)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--rounds", type=int, default=5, help="shapes: timing rounds")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 wastes least when other jobs share the cores (no spinning at barriers)")
    a = ap.parse_args(argv)
    if a.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(a.threads)
    return {"prompts": cmd_prompts, "shapes": cmd_shapes, "target": cmd_target, "draft": cmd_draft,
            "export": cmd_export, "all": cmd_all}[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())
