"""One process of a step-overhead measurement, launched by ``benchmarks/step_overhead.py`` (torchrun).

    step_worker.py gpt ARGS...      stock examples/gpt/pretrain_gpt.py with ARGS
    step_worker.py mimo ARGS...     examples/mimo/pretrain_mimo.py with ARGS
    step_worker.py encoder STEPS WARMUP ARGS...
                                    the first encoder of the MiMo ARGS alone, on one process:
                                    STEPS x (forward + backward of every microbatch) at its
                                    micro-batch size, like one training step of its grid

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

    if cpu_simulation.CLI_FLAG in argv:
        cpu_simulation.activate()
    out = os.environ.get("STEP_PROBE_OUT")
    if out:
        import collective_probe

        collective_probe.activate(out)
    sys.argv = [str(SCRIPTS[mode]), *argv]
    runpy.run_path(str(SCRIPTS[mode]), run_name="__main__")


def encoder_alone(steps: int, warmup: int, argv: list[str]) -> None:
    """Time the first encoder (and its projection) alone; writes ``<STEP_PROBE_OUT>.encoder.json``."""
    from megatron_plugins import cpu_simulation

    cpu_simulation.activate()
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.training.global_vars import set_global_variables

    from megatron_plugins import megatron_compat
    from megatron_plugins.layout import encoder_micro_batch_size
    from megatron_plugins.language import language_config_from_args
    from megatron_plugins.launch import parse_mimo_args
    from megatron_plugins.topology import _collection, _grid, groups_of

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
    megatron_compat.ensure_global_memory_buffer()
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed, tp_rank=0, ep_rank=0, etp_rank=0)
    plugin = run.plugins[module.name]
    language = language_config_from_args(args).transformer
    spec = plugin.submodule_spec(plugin.transformer_config(language), language.hidden_size, pgc)
    submodule = spec.module.from_spec(spec, is_first_stage=True, is_last_stage=True)
    batch = encoder_micro_batch_size(run.layout, module.name, args.micro_batch_size)
    microbatches = args.global_batch_size // (args.micro_batch_size * run.layout.language.dp)
    sample = plugin.preprocessor().example_inputs()
    inputs = {key: value.expand(batch, *value.shape).clone() for key, value in sample.items()}
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        for _ in range(microbatches):
            output = submodule(encoder_inputs={module.name: inputs})
            output.backward(torch.ones_like(output))
        submodule.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    grid.destroy()
    dist.destroy_process_group()
    with open(f"{os.environ['STEP_PROBE_OUT']}.encoder.json", "w") as handle:
        json.dump({"seconds": times, "median": statistics.median(times),
                   "microbatches": microbatches, "micro_batch_size": batch}, handle)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "encoder":
        encoder_alone(int(rest[0]), int(rest[1]), rest[2:])
    else:
        run_entry_point(mode, rest)
