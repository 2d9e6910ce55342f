"""``torch.utils.flop_counter.FlopCounterMode`` over a forward and backward, a grouped
convolution's weight gradient counted as it runs: the counted side of the FLOPs checks
(:mod:`tests.harness.flops_cases`, :mod:`tests.harness.lora_flops_cases`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["counted"]


def _convolution_backward(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation,
                          transposed, output_padding, groups, output_mask, out_shape=None,
                          **kwargs) -> int:
    """FlopCounterMode's convolution backward, its weight gradient divided by the groups: torch
    counts a grouped convolution's weight gradient as a dense one's (``groups`` times the
    products; a depthwise kernel's gradient, Gated DeltaNet's, ``channels`` times)."""
    from torch.utils.flop_counter import conv_backward_flop

    def count(mask: list[bool]) -> int:
        return conv_backward_flop.__wrapped__(
            grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
            output_padding, groups, mask, out_shape=out_shape, **kwargs)

    return (count([output_mask[0], False, False])
            + count([False, output_mask[1], False]) // groups)


def counted(run: Callable[[], torch.Tensor]) -> int:
    """FlopCounterMode's total over ``run()``'s forward and, when its output needs one, the
    backward of the output's sum (a grouped convolution's weight gradient as it runs:
    :func:`_convolution_backward`)."""
    from torch.utils.flop_counter import FlopCounterMode

    grouped = {torch.ops.aten.convolution_backward: _convolution_backward}
    with FlopCounterMode(display=False, custom_mapping=grouped) as counter:
        output = run()
        if output.requires_grad:
            output.sum().backward()
    return counter.get_total_flops()
