"""One process of a step-overhead measurement, launched by ``benchmarks/step_overhead.py`` (torchrun).

    step_worker.py gpt ARGS...      stock examples/gpt/pretrain_gpt.py with ARGS
    step_worker.py mimo ARGS...     examples/mimo/pretrain_mimo.py with ARGS
    step_worker.py encoder STEPS WARMUP ARGS...
                                    the first encoder of the MiMo ARGS alone, on one process:
                                    STEPS x (its data, forward + backward of every microbatch)
                                    at its micro-batch size, like one training step of its grid

With ``STEP_PROBE_OUT`` set, :mod:`collective_probe` records the run (see its docstring).
"""

from __future__ import annotations

import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"gpt": ROOT / "examples" / "gpt" / "pretrain_gpt.py",
           "mimo": ROOT / "examples" / "mimo" / "pretrain_mimo.py"}


def run_entry_point(mode: str, argv: list[str]) -> None:
    """Run a stock entry point as ``__main__`` with the probe on when requested."""
    from megatron_plugins import cpu_simulation

    if cpu_simulation.FLAG in argv:
        from megatron_plugins.cpu_simulation import patches

        patches.activate()
    out = os.environ.get("STEP_PROBE_OUT")
    probe = None
    if out:
        import collective_probe

        probe = collective_probe.activate(out)
    sys.argv = [str(SCRIPTS[mode]), *argv]
    try:
        runpy.run_path(str(SCRIPTS[mode]), run_name="__main__")
    finally:
        if probe is not None:
            probe.save()


def encoder_alone(steps: int, warmup: int, argv: list[str]) -> None:
    """Time the first encoder (and its projection) alone, as the MiMo build trains it (its
    precision wrapper and DDP, on one rank) and on its own data (the run's source through the
    encoder's preprocessor), as stock's language step includes its data; writes
    ``<STEP_PROBE_OUT>.encoder.json`` with each step's total and its data part."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import get_megatron_ddp_config

    from megatron_plugins.compat import model_build
    from megatron_plugins.data.addressing import RankSlice
    from megatron_plugins.data.sources import build_source
    from megatron_plugins.launch.pretrain import parse_mimo_args
    from megatron_plugins.model.lifecycle import prepare_module
    from megatron_plugins.parallel.topology import _collection, _grid, groups_of

    run = parse_mimo_args(argv)
    args = run.args
    set_global_variables(args, build_tokenizer=False)
    dist.init_process_group("gloo", rank=0, world_size=1)
    [module, *_] = run.layout.encoders
    if module.size != 1:
        raise SystemExit(f"encoder alone: grid {module.name} must have one rank, has {module.size}")
    grid = _grid(module, "gloo")
    for _, view, dims in groups_of(module):
        grid.create_pg(list(dims), view=view)
    pgc = _collection(module, grid)
    model_build.ensure_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, tp_rank=0, ep_rank=0, etp_rank=0)
    plugin = run.plugins[module.name]
    language = run.language.transformer
    config = plugin.transformer_config(language)
    spec = plugin.submodule_spec(config, language.hidden_size, pgc)
    submodule = spec.module.from_spec(spec, is_first_stage=True, is_last_stage=True)
    model = prepare_module(submodule, module.name, pgc, config, get_megatron_ddp_config(args))
    microbatches = args.global_batch_size // (args.micro_batch_size * run.layout.language.dp)
    stream = build_source(args, run.plugins).open(
        "train", RankSlice.of(run.layout, module.name, 0, args.micro_batch_size), 0, None)
    times, data_times = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        data = 0.0
        model.zero_grad_buffer()
        for _ in range(microbatches):
            fetched = time.perf_counter()
            _, batch = next(stream)
            data += time.perf_counter() - fetched
            output = model(encoder_inputs=batch["modality_inputs"][module.name])
            output.backward(torch.ones_like(output))
        if step >= warmup:
            times.append(time.perf_counter() - start)
            data_times.append(data)
    grid.destroy()
    dist.destroy_process_group()
    with open(f"{os.environ['STEP_PROBE_OUT']}.encoder.json", "w") as handle:
        json.dump({"seconds": times, "median": statistics.median(times),
                   "data_seconds": data_times, "data_median": statistics.median(data_times),
                   "microbatches": microbatches}, handle)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "encoder":
        encoder_alone(int(rest[0]), int(rest[1]), rest[2:])
    else:
        run_entry_point(mode, rest)
