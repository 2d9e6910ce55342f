"""Reference implementations of what megatron-core 0.19.2 runs only through Transformer Engine or
Triton: packed (THD) attention, context-parallel attention and the positions each CP rank holds.

They compute the same thing in plain torch, so the CPU simulation (and a GPU without those
libraries) runs the same model; each is tested against a plain computation.
"""

__all__ = []
