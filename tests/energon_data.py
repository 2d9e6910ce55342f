"""The generated image + audio + caption dataset and tokenizer the real-data tests train on."""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

SAMPLES = 300


@lru_cache(maxsize=None)
def synthetic_dataset(kind: str = "image_audio_caption") -> Path:
    """A prepared Energon dataset (``energon/``) and its tokenizer (``tokenizer/``), made once per
    test process by the README's own tools."""
    from tools.make_synthetic_dataset import make_synthetic, prepare

    root = Path(tempfile.mkdtemp(prefix=f"mimo-{kind}-"))
    make_synthetic(root, SAMPLES, kind, seed=0)
    prepare(root, kind, seed=0, quiet=True)
    return root


def energon_flags(root: Path, *, workers: int = 0) -> tuple[str, ...]:
    """Flags that put the tiny model on the real data (they override the mock's NullTokenizer)."""
    return ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "tokenizer"),
            "--data-path", str(root / "energon"), "--num-workers", str(workers))
