"""``torch.utils.flop_counter.FlopCounterMode`` over a forward and backward, a grouped
convolution's weight gradient counted as it runs and SDPA's CPU flash kernel counted as torch
counts its CUDA kernels: the counted side of the FLOPs checks
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


def _score_pairs(query_shape: tuple[int, ...], key_shape: tuple[int, ...],
                 is_causal: bool) -> int:
    """Query-key pairs per batch row and head the kernel computes: a causal mask's upper
    triangle (top-left aligned, as SDPA's) is skipped, ``L (L + 1) / 2`` pairs for ``L x L``."""
    sq, sk = query_shape[2], key_shape[2]
    if not is_causal:
        return sq * sk
    return sum(min(i + 1, sk) for i in range(sq))


def _sdpa_cpu(query_shape, key_shape, value_shape, dropout_p=0.0, is_causal=False, *,
              out_shape=None, **kwargs) -> int:
    """SDPA's CPU flash forward, which FlopCounterMode does not count: QK^T and PV over the
    pairs it computes (torch counts its CUDA kernels' pairs the same, but not causal skipping,
    which the CPU and CUDA flash kernels do)."""
    batch, heads, _, dim = query_shape
    return 2 * batch * heads * _score_pairs(query_shape, key_shape, is_causal) * (
        dim + value_shape[-1])


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, out_shape_,
                       logsumexp_shape, dropout_p=0.0, is_causal=False, *, out_shape=None,
                       **kwargs) -> int:
    """Its backward: the scores recomputed, the probabilities' and the value gradient, the
    query and key gradients (five products, as torch counts its CUDA kernels' backward)."""
    batch, heads, _, dim = query_shape
    return 2 * batch * heads * _score_pairs(query_shape, key_shape, is_causal) * (
        3 * dim + 2 * value_shape[-1])


def counted(run: Callable[[], torch.Tensor]) -> int:
    """FlopCounterMode's total over ``run()``'s forward and, when its output needs one, the
    backward of the output's sum (a grouped convolution's weight gradient as it runs:
    :func:`_convolution_backward`; SDPA's CPU kernel: :func:`_sdpa_cpu`)."""
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {torch.ops.aten.convolution_backward: _convolution_backward,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
                   _sdpa_cpu_backward}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        output = run()
        if output.requires_grad:
            output.sum().backward()
    return counter.get_total_flops()
