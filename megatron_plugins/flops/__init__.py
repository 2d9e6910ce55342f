"""FLOPs per module from the actual batch: torch-free formulas over real token layouts.

:mod:`.count` holds the value (:class:`~.count.Flops`: forward, backward, recomputation; model
vs hardware FLOPs) and a module's work sorted by what its backward computes
(:class:`~.count.Work`, frozen or trained); :mod:`.transformer` the layer formulas (attention per
segment, GQA, plain and gated MLPs, MoE); :mod:`.gated_delta_net` Qwen3.5's linear-attention
layers as the reference kernels run them; :mod:`.language` the language model over a
microbatch's rows and segments. Encoders count their items with these
(:meth:`~megatron_plugins.encoders.base.EncoderPlugin.item_flops`). Below ``weights`` and
``encoders``; nothing here imports torch or Megatron. See docs/performance.md.
"""

__all__ = []
