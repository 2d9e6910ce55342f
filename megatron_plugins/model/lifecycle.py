"""The post-build distributed lifecycle of a rank-local MiMo model, one active module at a time.

Each module this rank runs is frozen as asked, given its LoRA adapters (:mod:`megatron_plugins.peft`), wrapped for precision, materialized from the meta
device and wrapped in DDP by Megatron's own ``prepare_existing_model_chunks_for_distributed_training``
on *that module's* process groups, then put back into the ``MimoModel``. The language model gets
stock ``Float16Module``; encoders get :class:`EncoderPrecisionWrapper`, which keeps their output
in model precision for the cross-grid send instead of upcasting it to fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.mimo import MimoModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models.dist_utils import (
    prepare_existing_model_chunks_for_distributed_training,
)

from megatron_plugins.compat import model_build
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.peft.flags import LoraSpec
from megatron_plugins.peft.layers import adapt, module_parts

__all__ = ["EncoderPrecisionWrapper", "Freeze", "prepare_active_modules", "prepare_module"]


class EncoderPrecisionWrapper(Float16Module):
    """Runs an encoder in model precision and returns its output in that precision.

    Unlike ``Float16Module`` it casts floating keyword inputs too (MiMo passes encoder inputs as
    keywords), never upcasts the output (the bridge sends ``pipeline_dtype``), and also wraps fp32
    encoders, so Megatron always finds the encoder's config on the module. Being a
    ``Float16Module``, it is unwrapped by MiMo's checkpoint code like the stock wrapper.
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module) -> None:
        MegatronModule.__init__(self, config)
        self.fp16, self.bf16 = config.fp16, config.bf16
        self.vp_size, self.vp_stage = None, None
        self.pg_collection = getattr(module, "pg_collection", None)
        self.dtype = config.params_dtype if (config.fp16 or config.bf16) else None
        self.add_module("module", module.to(self.dtype) if self.dtype is not None else module)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.dtype)
        if isinstance(value, Mapping):
            return {key: self._cast(item) for key, item in value.items()}
        return value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.dtype is not None:
            inputs = tuple(self._cast(value) for value in inputs)
            kwargs = {key: self._cast(value) for key, value in kwargs.items()}
        return self.module(*inputs, **kwargs)


@dataclasses.dataclass(frozen=True)
class Freeze:
    """What not to train: the language model, whole encoders, or only encoders' projections."""

    language_model: bool = False
    encoders: frozenset[str] = frozenset()
    projections: frozenset[str] = frozenset()


def _freeze(module: torch.nn.Module, name: str, freeze: Freeze) -> None:
    if name == LANGUAGE:
        frozen = [module] if freeze.language_model else []
    elif name in freeze.encoders:
        frozen = [module]
    else:
        frozen = list(module.input_projections) if name in freeze.projections else []
    for part in frozen:
        part.requires_grad_(False)


def prepare_module(
    module: torch.nn.Module,
    name: str,
    pgc: ProcessGroupCollection,
    config: TransformerConfig,
    ddp_config: DistributedDataParallelConfig | None,
    *,
    data_parallel_random_init: bool = False,
    overlap_param_gather_with_optimizer_step: bool = False,
) -> MegatronModule:
    """One module's stock lifecycle on its own groups: precision wrapper, materialization from
    the meta device and (with a ``ddp_config``, copied because Megatron writes its bucket size
    into it) DDP. Also serves measurements of one module alone."""
    model_build.bind_tp_group(module, pgc.tp)
    wrapper = Float16Module if name == LANGUAGE else None
    if name != LANGUAGE:
        module = EncoderPrecisionWrapper(config, module)
    with model_build.exact_fp32_router_buffers(module):
        [prepared] = prepare_existing_model_chunks_for_distributed_training(
            [module], config, pgc,
            ddp_config=dataclasses.replace(ddp_config) if ddp_config is not None else None,
            overlap_param_gather_with_optimizer_step=overlap_param_gather_with_optimizer_step,
            wrap_with_ddp=ddp_config is not None,
            data_parallel_random_init=data_parallel_random_init,
            mixed_precision_wrapper=wrapper,
        )
    return prepared


def prepare_active_modules(
    model: MimoModel,
    module_pgs: Mapping[str, ProcessGroupCollection],
    configs: Mapping[str, TransformerConfig],
    ddp_configs: Mapping[str, DistributedDataParallelConfig],
    *,
    freeze: Freeze = Freeze(),
    lora: Mapping[str, LoraSpec] | None = None,
    seed: int = 0,
    wrap_with_ddp: bool = True,
    data_parallel_random_init: bool = False,
    overlap_param_gather_with_optimizer_step: bool = False,
) -> None:
    """Apply :func:`prepare_module` to every module in ``module_pgs`` (this rank's), in place,
    after freezing it and adding the ``lora`` adapters of its parts (by part; ``seed`` draws
    their start); ``configs`` and ``ddp_configs`` hold each module's TransformerConfig and DDP
    config."""
    for name, pgc in module_pgs.items():
        module = model.language_model if name == LANGUAGE else model.modality_submodules[name]
        _freeze(module, name, freeze)
        for part, piece in module_parts(model, name).items():
            if lora and part in lora:
                adapt(piece, lora[part], seed)
        prepared = prepare_module(
            module, name, pgc, configs[name], ddp_configs[name] if wrap_with_ddp else None,
            data_parallel_random_init=data_parallel_random_init,
            overlap_param_gather_with_optimizer_step=overlap_param_gather_with_optimizer_step)
        if name == LANGUAGE:
            model.language_model = prepared
        else:
            model.modality_submodules[name] = prepared
