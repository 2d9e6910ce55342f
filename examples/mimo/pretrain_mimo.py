"""Heterogeneous MiMo pretraining through Megatron's stock ``pretrain()``.

    torchrun --nproc-per-node 3 examples/mimo/pretrain_mimo.py --cpu-simulation \\
        --encoder vision=vit --grid vision:dp=1 --grid language:dp=2 <stock Megatron flags>

Each encoder trains on its own ranks (``--grid NAME:tp=..,dp=..``), the language model on the
last ranks (``--grid language:tp=..,pp=..,dp=..,ep=..``). ``--cpu-simulation`` runs the stock loop
on CPU over gloo. A bad flag ends every rank at once with one line naming it (exit code 2); a bad
layout does so before torch or Megatron is imported.
"""

import sys

from megatron_plugins import cpu_simulation, preflight

# The layout is checked before torch and Megatron are imported, so a refused one exits at once.
_checked = preflight.run(sys.argv[1:], "pretrain_mimo.py") if __name__ == "__main__" else None
if isinstance(_checked, int):
    sys.exit(_checked)

if cpu_simulation.FLAG in sys.argv:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()

from megatron_plugins.errors import UsageError, report  # noqa: E402
from megatron_plugins.launch import parse_mimo_args, train  # noqa: E402


def main() -> int:
    """Parse and check, bring up the grids, run stock pretrain(), tear down."""
    try:
        run = parse_mimo_args(checked=_checked)
    except UsageError as error:
        return report("pretrain_mimo.py", error)
    try:
        train(run)
    except UsageError as error:  # e.g. HF weights that do not fit, found once the model is built
        return report("pretrain_mimo.py", error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
