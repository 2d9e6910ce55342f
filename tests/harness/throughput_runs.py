"""Measured MiMo runs for the throughput, timeline and profile tests (issue 39).

``measured_run`` trains the tiny MiMo model through the entry point's own steps with the
measurement flags given and returns, per rank, the log lines stock printed there (with the MiMo
fields), how many interval gathers the measurement made, and the FLOPs, tokens and items of
every training microbatch the rank's witness streams recorded, counted independently of the
measurement: from the consumed samples' keys, replayed through the mock source, and the flops/
formulas; and the FLOPs stock's ``train()`` returned as its running total. TensorBoard scalars,
the timeline and the profile are files under the run's folder.
"""

from __future__ import annotations

import functools
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from tests.harness.multiprocess import run_in_processes
from tests.models.tiny import TINY_TRANSFORMER

MEASURED = [*TINY_TRANSFORMER, "--train-iters", "6", "--eval-interval", "100",
            "--log-interval", "2", "--log-throughput"]
"""Six steps, logged at 1, 2, 4 and 6; no evaluation."""


def _expected_counts(session: Any, totals: dict[str, list[float]]) -> None:
    """Count every training microbatch the rank's witness streams record, into ``totals``
    (module -> [model FLOPs, tokens, items]), from its samples' keys."""
    from megatron_plugins.data.streams import LENGTH, is_witness
    from megatron_plugins.encoders.counting import microbatch_flops
    from megatron_plugins.flops.language import language_flops

    run, model = session.run, session.config.model
    language = model.language.transformer
    source = run.source

    def samples(keys: list[str]) -> list[tuple[str, int]]:
        return [(split, int(index)) for split, _, index in (key.partition("/") for key in keys)]

    def count(module: str, keys: list[str]) -> list[float]:
        if module == "language":
            flops = language_flops(language, run.args.padded_vocab_size,
                                   [[run.args.seq_length]] * len(keys), input_grad=True)
            return [float(flops.model), float(sum(int(source.text(split, index)[LENGTH])
                                                  for split, index in samples(keys))), 0.0]
        plugin = run.plugins[module]
        sizes = [size for split, index in samples(keys)
                 for size in source.item_sizes(module, split, index)]
        work = microbatch_flops(plugin, sizes, plugin.transformer_config(language),
                                language.hidden_size)
        return [float(work.flops().model), float(sum(map(plugin.item_tokens, sizes))),
                float(len(sizes))]

    for module in session.topology.active_modules:
        if not is_witness(session.topology, module):
            continue
        guard = session.guard[module]
        stock = guard.record
        totals[module] = [0.0, 0.0, 0.0]

        def recording(keys, positions, counts, module=module, stock=stock):
            totals[module] = [a + b for a, b in zip(totals[module], count(module, list(keys)))]
            stock(keys, positions, counts)

        guard.record = recording


def measured_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of a measured run (see the module docstring)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import megatron.training.training as training

    from megatron_plugins.launch.pretrain import parse_mimo_args, train
    from megatron_plugins.performance.meter import IntervalMeter

    lines: list[str] = []
    printed = training.print_rank_last

    def keep(line: str) -> None:
        lines.append(line)
        printed(line)

    training.print_rank_last = keep
    gathers = []
    gather = IntervalMeter.gather
    IntervalMeter.gather = lambda self: gathers.append(1) or gather(self)
    returned = []
    stock_train = training.train

    @functools.wraps(stock_train)
    def keeping_train(*args, **kwargs):
        returned.append(stock_train(*args, **kwargs))
        return returned[-1]

    training.train = keeping_train
    expected: dict[str, list[float]] = {}
    train(parse_mimo_args(argv), lambda session: _expected_counts(session, expected))
    [(_, flops_so_far)] = returned
    return {"lines": [line for line in lines if re.search(r" iteration +\d+/ *\d+ \|", line)],
            "gathers": len(gathers), "expected": expected, "flops_so_far": flops_so_far}


@lru_cache(maxsize=None)
def measured_run(nproc: int, flags: tuple[str, ...], timeout: float = 900.0
                 ) -> tuple[Path, list[dict[str, Any]]]:
    """Train with ``flags`` (``{run}`` in them is the run's folder) on ``nproc`` ranks; returns
    the folder (TensorBoard logs under ``tensorboard/``) and each rank's results."""
    folder = Path(tempfile.mkdtemp(prefix="measured-"))
    argv = [*MEASURED, *(flag.replace("{run}", str(folder)) for flag in flags),
            "--tensorboard-dir", str(folder / "tensorboard")]
    return folder, run_in_processes(measured_rank, nproc, timeout=timeout, simulated=True,
                                    args=(argv,))
