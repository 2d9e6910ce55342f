"""Heterogeneous MiMo pretraining through Megatron's stock ``pretrain()``.

    torchrun --nproc-per-node 3 examples/mimo/pretrain_mimo.py --cpu-simulation \\
        --encoder vision=vit --grid vision:dp=1 --grid language:dp=2 <stock Megatron flags>

Each encoder trains on its own ranks (``--grid NAME:tp=..,dp=..``), the language model on the
last ranks (``--grid language:tp=..,pp=..,dp=..,ep=..``). ``--cpu-simulation`` runs the stock loop
on CPU over gloo. A bad flag ends every rank at once with one line naming it (exit code 2); a bad
layout does so before torch or Megatron is imported; a sample that cannot train ends its rank
with one line naming it (torchrun then stops the others).

Nothing heavy is imported at module level: a process that ``multiprocessing`` spawns re-imports
this file as ``__mp_main__`` (stock dist-checkpoint saving starts a spawned Manager on each rank
at the first save), and it must start in a moment, not import torch and Megatron again.
"""

import sys

from megatron_plugins.launch import preflight

PROG = "pretrain_mimo.py"


def main() -> int:
    """Check the layout before torch or Megatron is imported (switching the CPU simulation on
    when asked), then parse, bring up the grids, run stock pretrain(), tear down."""
    checked = preflight.run(sys.argv[1:], PROG)
    if isinstance(checked, int):
        return checked

    from megatron_plugins.errors import UsageError, report
    from megatron_plugins.launch.pretrain import parse_mimo_args, train
    from megatron_plugins.media.codec import BadSampleError

    try:
        # HF weights that do not fit are found once the model is built, inside train(); a
        # sample that cannot train (its placeholder runs overflow a packed row) mid-run.
        train(parse_mimo_args(checked=checked))
    except (UsageError, BadSampleError) as error:
        return report(PROG, error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
