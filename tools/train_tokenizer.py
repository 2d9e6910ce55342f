"""Train a tiny HuggingFace tokenizer offline, for small runs and tests without a downloaded one.

A BPE model over words marked by a leading ``▁`` (SentencePiece's metaspace; unseen words still
split into known pieces) with ``<pad>``, ``<eos>``, ``<bos>`` and ``<unk>``. The same texts give
the same file every time: the trainer numbers every symbol from the sorted alphabet (an
end-of-word suffix would number suffixed symbols in hash order, so ids changed between runs).
Saved with ``save_pretrained`` so that
``AutoTokenizer.from_pretrained(DIR)`` and stock Megatron's ``--tokenizer-type
HuggingFaceTokenizer --tokenizer-model DIR`` load it.

    python -m tools.train_tokenizer --texts captions.txt qa.jsonl --vocab-size 512 --output tok/
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
JSONL_FIELDS = ("caption", "text", "question", "answer", "transcript")
"""Fields of a .jsonl object whose strings are training text (the dataset tools' sample fields)."""
_WORD_START = "\u2581"


def train_tokenizer(texts: Iterable[str], vocab_size: int, output: Path) -> Path:
    """Train on ``texts`` and save to ``output``; returns ``output``.

    ``vocab_size`` bounds the merges; every character seen is kept too, so a tiny value still
    yields a tokenizer that covers the texts.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement=_WORD_START, prepend_scheme="always"),
        pre_tokenizers.Punctuation()])
    tokenizer.decoder = decoders.Metaspace(replacement=_WORD_START, prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS,
                                      bos_token=BOS, unk_token=UNK)
    output.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(output))
    return output


def read_texts(path: Path) -> Iterator[str]:
    """One text per line; in a .jsonl file, each object's :data:`JSONL_FIELDS` strings."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                yield line.rstrip("\n")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--texts {path}:{number}: not a JSON object ({error})") from None
            yield from (record[key] for key in JSONL_FIELDS
                        if isinstance(record, dict) and isinstance(record.get(key), str))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, print the output folder; a bad flag exits 2 with one line."""
    parser = argparse.ArgumentParser(prog="python -m tools.train_tokenizer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--texts", nargs="+", type=Path, required=True,
                        help="text files (one text a line) or .jsonl files with "
                             + "/".join(JSONL_FIELDS) + " fields")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True, help="folder to save into")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.texts if not path.is_file()]
    if missing:
        parser.error(f"--texts: no such file: {', '.join(missing)}")
    if args.vocab_size < len(SPECIAL_TOKENS) + 1:
        parser.error(f"--vocab-size {args.vocab_size} is too small: give at least "
                     f"{len(SPECIAL_TOKENS) + 1} (the special tokens plus text)")
    try:
        texts = [text for path in args.texts for text in read_texts(path)]
    except ValueError as error:
        parser.error(str(error))
    if not texts:
        parser.error("--texts: the files hold no text")
    print(train_tokenizer(texts, args.vocab_size, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
