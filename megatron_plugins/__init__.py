"""Plugins for Megatron-LM's stock ``pretrain()``: heterogeneous MiMo training, each encoder on
ranks of its own or colocated on the language model's ranks, activations crossing the grids.

The package is built in layers, each folder importing only the ones below it:
``errors`` and ``cpu_simulation`` < ``ops`` (reference kernels) < ``compat`` (bridges over the
wheel's gaps) < ``parallel`` (the layout and its groups) and ``media`` < ``flops`` (torch-free
FLOPs formulas) < ``weights`` < ``encoders`` < ``data`` < ``step`` < ``model`` < ``performance``
(what a run measures about its own speed, and the layout advisor's cost model) < ``launch``.
Importing the package (or any module of it) changes nothing in torch or Megatron: the CPU
simulation and the wheel bridges act only when an entry point calls them. See README.md and
docs/architecture.md.
"""

__all__ = []
