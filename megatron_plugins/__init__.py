"""Plugins for Megatron-LM's stock ``pretrain()``: heterogeneous, non-colocated MiMo training.

Importing the package (or any module of it) changes nothing in torch or Megatron: the CPU
simulation and the wheel bridges act only when an entry point calls them. See README.md.
"""

__all__ = []
