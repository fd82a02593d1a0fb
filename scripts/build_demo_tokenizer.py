"""Builds the byte-level BPE tokenizer of configs/hf-tiny.yaml into configs/hf-tiny-tokenizer/.

The files are committed, so every peer of the demo loads the very same tokenizer offline; this script says how
they were made: BPE trained with the `tokenizers` library on the top-level modules of the running Python's
standard library, wrapped in transformers' PreTrainedTokenizerFast. Another Python's library gives another
vocabulary, which the hf task's fingerprint would tell apart, so run it only to change the tokenizer.

    .venv/bin/python scripts/build_demo_tokenizer.py [--vocab-size 2048] [--out configs/hf-tiny-tokenizer]
"""

from __future__ import annotations

import argparse
import glob
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
SPECIAL = ["<|endoftext|>"]


def build(files: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[0], bos_token=SPECIAL[0],
                                   unk_token=SPECIAL[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=REPO / "configs" / "hf-tiny-tokenizer")
    args = parser.parse_args()
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/[a-z]*.py"))
    build(files, args.vocab_size).save_pretrained(args.out)
    print(f"{args.out}: vocabulary of {args.vocab_size} from {len(files)} files")


if __name__ == "__main__":
    main()
