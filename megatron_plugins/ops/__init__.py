"""Reference implementations of what megatron-core 0.19.2 runs only through Transformer Engine or
Triton: packed (THD) attention, context-parallel attention and the positions each CP rank holds;
and the local path's fast attention on torch's SDPA kernels, tested against those references.

They compute the same thing in plain torch, so the CPU simulation (and a GPU without those
libraries) runs the same model; each is tested against a plain computation.
"""

__all__ = ["REFERENCE_ATTENTION"]

REFERENCE_ATTENTION = "mimo_reference_attention"
"""Attribute of a ``TransformerConfig`` (not a field: set on the object by the language config,
copied by ``encoders.base.encoder_config``) asking local layers for the reference attentions
(``--reference-attention``); here, torch-free, so the FLOPs formulas read it too."""
