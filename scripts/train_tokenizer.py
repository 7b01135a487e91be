"""Train the byte-level BPE tokenizer shared by the target and draft models.

    .venv/bin/python scripts/train_tokenizer.py --out runs/tokenizer

Llama-style: byte-level BPE, no BOS, `<|endoftext|>` is EOS (and separates documents).
Byte-level pre-tokenization without a prefix space makes decode(encode(text)) == text for any
valid UTF-8 text.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe.corpus import EOS_TOKEN, CorpusSpec, list_files, read_documents  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": EOS_TOKEN,
    "pad_token": EOS_TOKEN,
    "unk_token": None,
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1024,
}


def train_tokenizer(spec: CorpusSpec, vocab_size: int) -> Tokenizer:
    train_files, _ = list_files(spec)
    docs = read_documents(train_files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--stdlib", type=Path, default=CorpusSpec.root)
    args = ap.parse_args(argv)
    tok = train_tokenizer(CorpusSpec(root=args.stdlib, seed=args.seed), args.vocab_size)
    save_tokenizer(tok, args.out)
    print(f"tokenizer: vocab {tok.get_vocab_size()} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
