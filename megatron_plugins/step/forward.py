"""The ``forward_step_func`` stock ``pretrain()`` runs for a MiMo model, and its per-token loss.

Encoder ranks feed their inputs and hand their outputs to the schedule (which sends them across
the grid), each output checked against the token counts its items declared and labelled with
its samples' counts (how the bridge splits it over language replicas); language ranks feed text
and, on the last stage, return the summed token loss and the token count (with
``--pack-sequences`` a batch carries its row's THD segments as ``packing_kwargs``, read on every
language stage). With ``--balance-encoder-work`` the first language stage first puts each balanced
encoder's received rows in its samples' order. The loss is never divided here: the global token
count divides the gradients once (see :mod:`megatron_plugins.step.grad_sync`) and the logged ``lm
loss``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, Callable

import torch
from megatron.core.utils import unwrap_model

from megatron_plugins.compat import MegatronCompatError
from megatron_plugins.data.streams import COLOCATED, ITEM_TOKENS, RECEIVED_ORDER
from megatron_plugins.encoders import EncoderPluginError
from megatron_plugins.step import phases

__all__ = ["COLOCATED_ROWS", "check_encoder_rows", "forward_step", "to_device"]

COLOCATED_ROWS = "colocated_rows"
"""Batch entry the colocated schedule (:mod:`megatron_plugins.step.colocated`) hands the forward
step on a rank hosting encoders: per hosted encoder, the rows of this microbatch's samples that
the language first stage merges (empty on later stages)."""

SPLIT_SIZES = "_mimo_bridge_split_sizes"
"""Attribute of an encoder output that megatron-core's bridge splits a fan-out by (one entry per
sample, bridge_communicator.py ``_split_tensor_at_batch_dim``)."""


def to_device(value: Any) -> Any:
    """A batch (or one encoder's inputs) on this rank's device, nested mappings included: the data
    streams hand over host tensors."""
    if isinstance(value, torch.Tensor):
        return value.cuda(non_blocking=True)
    if isinstance(value, Mapping):
        return {key: to_device(item) for key, item in value.items()}
    return value


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed masked token loss, token count, and the stock two-element ``lm loss`` report."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().clone().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def check_encoder_rows(name: str, output: torch.Tensor,
                       item_tokens: list[tuple[int, ...]]) -> list[int]:
    """Each sample's rows, once ``output`` is checked to hold the rows its items declared (an
    encoder plugin's ``item_tokens`` that does not match its network fails here, named)."""
    per_sample = [sum(counts) for counts in item_tokens]
    if output.shape[0] != sum(per_sample):
        raise EncoderPluginError(
            f"--encoder {name}: the encoder returned {output.shape[0]} rows for a microbatch "
            f"whose items declare {sum(per_sample)} tokens ({item_tokens} per sample); "
            "its item_tokens(size) must give the rows each item's output has")
    return per_sample


def _label_encoder_outputs(outputs: Mapping[str, torch.Tensor],
                           item_tokens: Mapping[str, list[tuple[int, ...]]]) -> None:
    """Check each encoder output and give it its samples' counts: with variable counts the
    bridge must split it per language replica by samples."""
    for name, output in outputs.items():
        setattr(output, SPLIT_SIZES, check_encoder_rows(name, output, item_tokens[name]))


def _in_sample_order(model: torch.nn.Module, orders: Mapping[str, torch.Tensor]) -> None:
    """Reorder the encoder outputs the schedule handed the first language stage (rows in the
    fan-in group's replica order) into the batch's sample order. The gradient flows back through
    the index in received order, as the bridge splits it per replica (Gap 15)."""
    mimo = unwrap_model(model)
    received = getattr(mimo, "input_tensors", None)
    if not isinstance(received, dict):
        return  # a later pipeline stage: it receives hidden states, not encoder outputs
    mimo.input_tensors = {
        name: (tensor.index_select(0, orders[name]) if name in orders and tensor is not None
               else tensor)
        for name, tensor in received.items()}


def _model_position_ids(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Multimodal RoPE's ids come per sample (``[B, 3, S]``); the model takes ``[3, B, S]``."""
    if position_ids is None or position_ids.dim() != 3:
        return position_ids
    return position_ids.transpose(0, 1).contiguous()


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module
                 ) -> tuple[Any, Callable]:
    """One microbatch through this rank's part of the MiMo model."""
    batch = next(data_iterator)
    if COLOCATED in batch:
        raise MegatronCompatError(
            "a batch of a rank hosting encoders reached the forward step with its encoder inputs: "
            "the schedule is not megatron_plugins.step.colocated.ColocatedSchedule (take it from "
            "megatron.training.training.get_forward_backward_func, which compat Gap 24 wraps)")
    colocated = batch.pop(COLOCATED_ROWS, None)
    phases.consumed(batch)
    batch = to_device(batch)
    if colocated:
        mimo = unwrap_model(model)
        mimo.input_tensors = {**(getattr(mimo, "input_tensors", None) or {}), **colocated}
    if RECEIVED_ORDER in batch:
        _in_sample_order(model, batch[RECEIVED_ORDER])
    output, loss_mask = model(
        input_ids=batch.get("tokens"),
        position_ids=_model_position_ids(batch.get("position_ids")),
        attention_mask=batch.get("attention_mask"),
        loss_mask=batch.get("loss_mask"),
        labels=batch.get("labels"),
        modality_inputs=batch.get("modality_inputs"),
        packing_kwargs=batch.get("packing_kwargs"),
    )
    if batch.get("tokens") is None and isinstance(output, Mapping):
        _label_encoder_outputs(output, batch[ITEM_TOKENS])
    return output, partial(loss_func, loss_mask)
