"""Bridge for Gated DeltaNet layers without flash-linear-attention (Gap 30).

megatron-core 0.19.2's ``GatedDeltaNet`` (``megatron/core/ssm/gated_delta_net``) runs its
convolution, q/k normalisation and chunked delta rule through flash-linear-attention's Triton
kernels, which need a GPU; without the package the layer refuses to build. The CPU simulation
(and a GPU without the package) binds the plain torch kernels of
:mod:`megatron_plugins.ops.gated_delta_rule` in their place.
"""

from __future__ import annotations

from megatron_plugins.compat import record
from megatron_plugins.ops import gated_delta_rule

__all__ = ["use_reference_gdn_kernels"]

_KERNELS = ("causal_conv1d", "l2norm", "chunk_gated_delta_rule")


def use_reference_gdn_kernels() -> None:
    """Let megatron-core build and run ``GatedDeltaNet`` without flash-linear-attention, with the
    reference kernels (Gap 30). Called before the model with such layers is built; changes nothing
    where flash-linear-attention is installed; applying it again changes nothing.

    Gap 30 (Gated DeltaNet needs flash-linear-attention): ``gated_delta_net/common.py`` imports
    ``causal_conv1d``, ``l2norm`` and ``chunk_gated_delta_rule`` from ``fla`` (Triton, GPU only)
    and ``_GDNBase.__init__`` raises ImportError when that failed (``HAVE_FLA`` False); ``gdn.py``
    holds its own references to the conv and the rule (``GatedDeltaNet`` reads the rule when it
    is built), and the package re-exports them. The kernels are bound wherever a module of the
    package holds one, and ``HAVE_FLA`` set.
    """
    from megatron.core.ssm import gated_delta_net
    from megatron.core.ssm.gated_delta_net import common, gdn

    if common.HAVE_FLA:
        return
    for module in (gated_delta_net, common, gdn):
        for name in _KERNELS:
            if hasattr(module, name):
                setattr(module, name, getattr(gated_delta_rule, name))
    common.HAVE_FLA = gated_delta_net.HAVE_FLA = True
    record("30")
