"""DeepStack on the language grid: the extra feature levels an encoder appends to each token's
row (Qwen3-VL, :attr:`~megatron_plugins.encoders.base.EncoderPlugin.deepstack_levels`), added to
the language model's hidden states at that encoder's positions after its first layers.

Such an encoder hands the first language stage rows ``[main, level 0, ..., level L-1]``, each the
language hidden size. :func:`install` (at build, first language stage only) puts a pre-hook on
the ``MimoModel`` and a forward hook on each of the first L decoder layers. Before MiMo merges the
received features into the text embeddings, the pre-hook leaves only the main part for MiMo's
stock merge and scatters level ``i`` to the encoder's token positions as an ``[S, B, H]`` tensor,
sharded as MiMo shards the combined embeddings (sequence / context parallel, packing); layer
``i``'s hook adds it to the layer's output, as transformers' ``Qwen3VLTextModel._deepstack_process``
does. Every part is a slice of the received tensor, so its gradient (which the schedule sends back
over the bridge) collects the main features' and every level's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.models.mimo import MimoModel
from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY, ModuleLayout
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import EncoderPluginError
from megatron_plugins.errors import FlagError

__all__ = ["DeepStack", "check_layers", "install"]


class DeepStack:
    """This first language stage's DeepStack: the levels per encoder, and the additions of the
    microbatch in flight (set by the model's pre-hook, read by the layers' hooks)."""

    def __init__(self, levels: Mapping[str, int], hidden_size: int) -> None:
        self.levels = dict(levels)
        self.hidden_size = hidden_size
        self.additions: list[torch.Tensor] = []

    def split_received(self, mimo: MimoModel, input_ids: torch.Tensor,
                       packing_kwargs: dict | None) -> None:
        """Leave the main features in ``mimo.input_tensors`` and put the levels, scattered and
        sharded, into :attr:`additions`."""
        self.additions = []
        received = getattr(mimo, "input_tensors", None)
        if not isinstance(received, dict) or input_ids is None:
            return  # a later stage, or an encoder rank
        hidden, depth = self.hidden_size, max(self.levels.values())
        batch, length = input_ids.shape
        scattered = None
        for name, levels in self.levels.items():
            rows = received.get(name)
            if rows is None or rows.shape[0] == 0:
                continue  # no items in this microbatch (MiMo's empty payload is main-width)
            if rows.shape[-1] != (1 + levels) * hidden:
                raise EncoderPluginError(
                    f"--encoder {name}: its rows are {rows.shape[-1]} wide, but its "
                    f"deepstack_levels {levels} and the language hidden size {hidden} make "
                    f"{(1 + levels) * hidden}; the encoder must return [main, {levels} levels]")
            received[name] = rows[:, :hidden]
            extra = torch.nn.functional.pad(rows[:, hidden:], (0, (depth - levels) * hidden))
            mask = (input_ids == mimo.special_token_ids[name]).unsqueeze(-1)
            canvas = torch.zeros(batch, length, depth * hidden, dtype=rows.dtype,
                                 device=rows.device)
            placed = canvas.masked_scatter(mask.expand_as(canvas), extra)
            scattered = placed if scattered is None else scattered + placed
        if scattered is None:
            return
        packed = mimo._build_packed_seq_params(packing_kwargs)
        sharded, _, _, _ = mimo._shard_language_inputs(scattered.transpose(0, 1).contiguous(),
                                                       None, None, packed)
        self.additions = list(sharded.split(hidden, dim=-1))

    def hook_layers(self, language: torch.nn.Module) -> None:
        """Have each of the language model's first L decoder layers add its level."""
        for index in range(max(self.levels.values())):
            language.decoder.layers[index].register_forward_hook(
                lambda module, args, output, index=index: self.add_after(index, output))

    def add_after(self, layer: int, output: Any) -> Any:
        """A layer's output with level ``layer`` added to its hidden states (unchanged when
        the microbatch has no such level)."""
        if layer >= len(self.additions):
            return output
        if isinstance(output, tuple):
            return (output[0] + self.additions[layer], *output[1:])
        return output + self.additions[layer]


def install(mimo: MimoModel, levels: Mapping[str, int]) -> DeepStack | None:
    """Hook DeepStack into this rank's model where it is the first language stage and some
    encoder has levels; None elsewhere. The layers' count was checked by :func:`check_layers`."""
    levels = {name: count for name, count in levels.items() if count > 0}
    role = mimo.role
    if (not levels or mimo.language_model is None or role.mode is not ModuleLayout.NON_COLOCATED
            or not role.is_first_stage(MIMO_LANGUAGE_MODULE_KEY)):
        return None
    language = mimo.language_model
    deepstack = DeepStack(levels, language.config.hidden_size)

    def split(module: MimoModel, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        deepstack.split_received(module, input_ids, kwargs.get("packing_kwargs"))

    def release(module: MimoModel, args: tuple, kwargs: dict, output: Any) -> None:
        deepstack.additions = []

    mimo.register_forward_pre_hook(split, with_kwargs=True)
    mimo.register_forward_hook(release, with_kwargs=True)
    deepstack.hook_layers(language)
    return deepstack


def check_layers(levels: Mapping[str, int], config: TransformerConfig) -> None:
    """Before any process group: the language layers DeepStack adds after all sit on the first
    pipeline stage, and are not recomputed (a recomputed layer would run without its level)."""
    levels = {name: count for name, count in levels.items() if count > 0}
    if not levels:
        return
    name, depth = max(levels.items(), key=lambda item: item[1])
    if config.recompute_granularity == "full":
        raise FlagError(f"--recompute-granularity full recomputes the language layers encoder "
                        f"{name}'s {depth} DeepStack levels are added after; use "
                        "--recompute-granularity selective or none")
    vp_stage = 0 if config.virtual_pipeline_model_parallel_size else None
    first = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=0)
    if first < depth:
        raise FlagError(
            f"encoder {name} adds {depth} DeepStack feature levels after language layers 0-"
            f"{depth - 1}, but the language pipeline (--pipeline-model-parallel-size "
            f"{config.pipeline_model_parallel_size}) puts only {first} of its --num-layers "
            f"{config.num_layers} on the first stage; give the first stage at least {depth} "
            f"layers (--decoder-first-pipeline-num-layers {depth}) or fewer language stages")
