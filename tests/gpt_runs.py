"""Stock GPT training runs (examples/gpt/pretrain_gpt.py) under the CPU simulation, for tests."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from functools import lru_cache
from typing import Any

import numpy as np

from tests.multiprocess import REPO_ROOT, run_in_processes
from tests.tensorboard_scalars import read_scalars

TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--make-vocab-size-divisible-by", "1", "--transformer-impl", "local",
    "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "10", "--seed", "1234",
    "--distributed-backend", "gloo", "--num-workers", "0", "--cpu-simulation",
]


def load_gpt_example() -> Any:
    """Import examples/gpt/pretrain_gpt.py as a module."""
    path = REPO_ROOT / "examples" / "gpt" / "pretrain_gpt.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_gpt_rank(argv: list[str], import_plugins: bool, install_bridge: bool) -> dict[str, np.ndarray]:
    """One rank of a stock GPT run; returns this rank's parameters after training."""
    from megatron_plugins import cpu_simulation

    cpu_simulation.activate()
    if import_plugins:
        import megatron_plugins  # noqa: F401  (the whole public surface, see test_import_side_effects)
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from megatron_plugins import megatron_compat

    sys.argv = ["pretrain_gpt.py", *argv]
    gpt = load_gpt_example()
    cfg = gpt.build_config()
    chunks: list[Any] = []
    cfg.model.post_wrap_hooks.append(lambda model: chunks.extend(model) or model)
    if install_bridge:
        megatron_compat.install()
    pretrain(cfg, gpt.datasets_provider, ModelType.encoder_or_decoder, gpt.forward_step)
    return {
        name: param.detach().float().cpu().numpy().copy()
        for chunk in chunks
        for name, param in chunk.named_parameters()
    }


def train_gpt(nproc: int, extra: tuple[str, ...] = (), *, tag: str = "run",
              import_plugins: bool = False, install_bridge: bool = True,
              timeout: float = 110.0) -> tuple[dict[int, float], list[dict[str, np.ndarray]]]:
    """Train the tiny GPT on ``nproc`` ranks; returns (lm loss per iteration, per-rank params)."""
    logdir = tempfile.mkdtemp(prefix=f"gpt-{tag}-")
    argv = [*TINY_GPT, *extra, "--tensorboard-dir", logdir]
    params = run_in_processes(train_gpt_rank, nproc, timeout=timeout,
                              args=(argv, import_plugins, install_bridge))
    return read_scalars(logdir, "lm loss"), params


@lru_cache(maxsize=None)
def cached_gpt_run(nproc: int, extra: tuple[str, ...], attempt: int) -> tuple[dict[int, float], list]:
    """Memoized :func:`train_gpt`, so several assertions share one run of each layout."""
    return train_gpt(nproc, extra, tag=f"{nproc}-{attempt}")
