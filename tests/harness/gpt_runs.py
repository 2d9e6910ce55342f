"""Stock GPT training runs (examples/gpt/pretrain_gpt.py) under the CPU simulation, for tests."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import tempfile
from typing import Any

import numpy as np

from tests.harness.multiprocess import REPO_ROOT, run_in_processes
from tests.harness.tensorboard_scalars import read_scalars
from tests.harness.worker_cache import once_per_run
from tests.models.tiny import TINY_TRANSFORMER

TINY_GPT = [*TINY_TRANSFORMER, "--mock-data", "--eval-interval", "10"]


def load_gpt_example() -> Any:
    """Import examples/gpt/pretrain_gpt.py as a module."""
    path = REPO_ROOT / "examples" / "gpt" / "pretrain_gpt.py"
    spec = importlib.util.spec_from_file_location("pretrain_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_gpt_rank(argv: list[str], import_plugins: bool, install_bridge: bool) -> dict[str, np.ndarray]:
    """One rank of a stock GPT run; returns this rank's parameters after training."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    if import_plugins:
        import megatron_plugins

        for module in pkgutil.walk_packages(megatron_plugins.__path__, "megatron_plugins."):
            importlib.import_module(module.name)
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    from megatron_plugins.compat import startup

    sys.argv = ["pretrain_gpt.py", *argv]
    gpt = load_gpt_example()
    cfg = gpt.build_config()
    chunks: list[Any] = []
    cfg.model.post_wrap_hooks.append(lambda model: chunks.extend(model) or model)
    if install_bridge:
        startup.install()
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
    params = run_in_processes(train_gpt_rank, nproc, timeout=timeout, simulated=True,
                              args=(argv, import_plugins, install_bridge))
    return read_scalars(logdir, "lm loss"), params


@once_per_run
def cached_gpt_run(nproc: int, extra: tuple[str, ...], attempt: int) -> tuple[dict[int, float], list]:
    """Memoized :func:`train_gpt`, so several assertions share one run of each layout."""
    return train_gpt(nproc, extra, tag=f"{nproc}-{attempt}")
