"""RMSNorm with an optionally 1-centred weight (``--apply-layernorm-1p``), without Transformer
Engine.

Megatron's local norm (``WrappedTorchNorm``) refuses ``layernorm_zero_centered_gamma``, which
Qwen3.5's norms need: its decoder, q/k and final norms scale by ``1 + weight`` (transformers'
``Qwen3_5RMSNorm``), its Gated DeltaNet output norm by ``weight`` (``Qwen3_5RMSNormGated``).
:class:`RMSNorm` computes both as transformers does (fp32 statistics and scale, output in the
input dtype), so the stored weight is the checkpoint's and export gives its bytes back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["PlainRMSNorm", "RMSNorm"]


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * (1 + weight)`` when the config says ``layernorm_zero_centered_gamma``,
    else ``* weight``; statistics and scale in fp32."""

    zero_centered_override: bool | None = None
    """A subclass fixing the centring whatever the config says (None: the config decides)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        centred = self.zero_centered_override
        self.zero_centered = (config.layernorm_zero_centered_gamma if centred is None
                              else centred)
        initial = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(initial(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised ``x`` in its own dtype."""
        return self._normalised(x, self.weight)

    def _normalised(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm: one fused kernel (and its backward keeps only x and 1 / rms) where
        # torch has one, on CUDA; the same arithmetic as transformers' several passes.
        shape = (x.shape[-1],)
        if self.zero_centered:
            return F.rms_norm(x.float(), shape, 1.0 + weight.float(), self.eps).type_as(x)
        # transformers' gated norm scales after returning to the input dtype.
        return weight.type_as(x) * F.rms_norm(x.float(), shape, eps=self.eps).type_as(x)


class PlainRMSNorm(RMSNorm):
    """:class:`RMSNorm` scaling by ``weight`` even when the model's other norms are 1-centred
    (Qwen3.5's Gated DeltaNet output norm). Given a ``tp_group``, it sums its weight's gradient
    over it: the norm runs per value head, each TP rank normalising only its own heads, so each
    rank's gradient is a part of the whole (stock sums it only under sequence parallelism)."""

    zero_centered_override = False
    tp_group: torch.distributed.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised ``x``; the weight's gradient summed over :attr:`tp_group`."""
        group = self.tp_group
        if group is None or group.size() == 1 or self.config.sequence_parallel:
            return super().forward(x)
        return self._normalised(x, copy_to_tensor_model_parallel_region(self.weight, group))
