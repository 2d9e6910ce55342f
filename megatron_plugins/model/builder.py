"""The MiMo model builder that stock ``pretrain()`` calls through ``ModelConfig.builder``.

``MimoBuildConfig`` is what goes into ``cfg.model``: its serialized fields describe the model
(stock language config, encoder providers, special tokens, seed, freezing); the live topology and
encoder plugins ride along in underscore fields, which Megatron never writes to checkpoints.
``MimoModelBuilder`` seeds this rank's module, builds the rank-local ``MimoModel`` (only that
module is instantiated), loads HF weights or Megatron checkpoints into it where asked
(``megatron_plugins.weights``), hooks in DeepStack where an encoder has levels
(:mod:`megatron_plugins.model.deepstack`), runs the pre/post wrap hooks, applies the distributed lifecycle,
installs cross-grid gradient sync and sets what the stock loop reads from the model
(``pg_collection``, ``rng_state_key_prefix``). Under language context parallelism MimoModel
splits packed rows without Transformer Engine too (``compat.context_parallel`` Gap 19).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, ClassVar

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.models.mimo import MimoModel, MimoModelConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models.base import ModelBuilder, ModelConfig, compose_hooks

from megatron_plugins.model import deepstack
from megatron_plugins.step.colocated import ColocatedEncoders, HostedEncoder
from megatron_plugins.compat import checkpointing, colocation, context_parallel, step_reductions
from megatron_plugins.compat import optimizer as compat_optimizer
from megatron_plugins.peft import optimizer as part_optimizer
from megatron_plugins.peft.checkpoint import omit_frozen_base
from megatron_plugins.peft.flags import lora_specs
from megatron_plugins.peft.layers import module_parts
from megatron_plugins.data.addressing import GuardSet
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.step.grad_sync import install_grad_sync
from megatron_plugins.model.language import language_model_spec
from megatron_plugins.parallel.layout import LANGUAGE
from megatron_plugins.model.lifecycle import Freeze, prepare_active_modules
from megatron_plugins.parallel.rng import ModuleRng, rng_state_key_prefix
from megatron_plugins.parallel.topology import HeteroTopology
from megatron_plugins.weights import load_pretrained
from megatron_plugins.weights.megatron_init import load_megatron_checkpoints

__all__ = ["MimoBuildConfig", "MimoModelBuilder"]


@dataclass
class MimoBuildConfig(ModelConfig):
    """Everything needed to build one rank's part of a heterogeneous MiMo model."""

    builder: ClassVar[str] = "megatron_plugins.model.builder.MimoModelBuilder"

    language: ModelConfig | None = None
    """Stock language-model config (``GPTModelConfig`` or ``HybridModelConfig``)."""
    special_token_ids: dict[str, int] = field(default_factory=dict)
    """Token id that marks each encoder's positions in the language input."""
    seed: int = 1234
    inference_rng_tracker: bool = False
    freeze_language_model: bool = False
    freeze_encoders: list[str] = field(default_factory=list)
    freeze_projections: list[str] = field(default_factory=list)
    encoder_overlap_grad_reduce: bool | None = None
    """Overlapped grad reduction for encoders; None follows the stock ``--overlap-grad-reduce``."""
    colocated_encoder_recompute: bool = False
    """Hosted encoders recompute their forward in the backward phase
    (``--colocated-encoder-recompute``, :attr:`ColocatedEncoders.recompute`)."""
    language_hf_weights: str | None = None
    """HF folder the language model is loaded from once built (``--language-hf-weights``)."""
    encoder_hf_weights: dict[str, str] = field(default_factory=dict)
    """HF folder per encoder network (``--encoder-hf-weights NAME=DIR``)."""
    hf_model: str | None = None
    """A whole HF VLM folder (``--hf-model``): its tower, projector and language model are
    loaded into the encoder holding it (``encoder_hf_weights``), its projection and the
    language model."""
    lora: list[str] = field(default_factory=list)
    """``--lora`` values: adapters per part, whose own weights are then frozen."""
    part_settings: dict[str, dict[str, float]] = field(default_factory=dict)
    """Every part's scheduler values when any ``--module-lr`` / ``--module-min-lr`` /
    ``--module-weight-decay`` is given (:func:`megatron_plugins.peft.optimizer.part_settings`)."""
    peft_base: dict[str, dict[str, str]] = field(default_factory=dict)
    """The frozen parts a LoRA run's checkpoints leave out, with the folder each came from."""
    language_megatron_checkpoint: str | None = None
    """torch_dist iteration folder the language model starts from
    (``--language-megatron-checkpoint``)."""
    encoder_megatron_checkpoints: dict[str, str] = field(default_factory=dict)
    """torch_dist iteration folder per encoder network
    (``--encoder-megatron-checkpoint NAME=DIR``)."""

    _topology: HeteroTopology | None = None
    _plugins: dict[str, EncoderPlugin] = field(default_factory=dict)
    _alignment: GuardSet | None = None
    """The training stream's data alignment guard, checked in the token-count all-reduce."""

    def encoder_configs(self) -> dict[str, TransformerConfig]:
        """Each encoder's TransformerConfig, derived from the language model's numerics."""
        return {name: plugin.transformer_config(self.language.transformer)
                for name, plugin in self._plugins.items()}


class MimoModelBuilder(ModelBuilder[MimoModel, MimoBuildConfig]):
    """Builds the rank-local ``MimoModel``; the ``pg_collection`` stock passes is the carrier and
    is not needed: every group comes from the config's topology."""

    def _topology(self) -> HeteroTopology:
        topology = self._model_config._topology
        if topology is None:
            raise RuntimeError(
                "MimoBuildConfig._topology is unset: build the topology "
                "(megatron_plugins.parallel.topology.build_topology) and attach it before pretrain()"
            )
        return topology

    def build_model(self, pg_collection: Any = None, pre_process: bool | None = None,
                    post_process: bool | None = None, vp_stage: int | None = None,
                    encoder_configs: dict[str, TransformerConfig] | None = None,
                    rng: ModuleRng | None = None) -> MimoModel:
        """This rank's ``MimoModel``: specs for every module, only the active ones instantiated
        (each hosted encoder inside its own RNG streams of ``rng``)."""
        cfg = self._model_config
        topology = self._topology()
        module_pgs = topology.module_pgs
        configs = encoder_configs or cfg.encoder_configs()
        hidden = cfg.language.transformer.hidden_size
        mimo_config = MimoModelConfig(
            language_model_spec=language_model_spec(cfg.language, module_pgs.get(LANGUAGE)),
            modality_submodules_spec={
                name: plugin.submodule_spec(configs[name], hidden, module_pgs.get(name))
                for name, plugin in cfg._plugins.items()
            },
            special_token_ids=dict(cfg.special_token_ids),
            module_to_grid_map=dict(topology.grids),
        )
        language_pgc = module_pgs.get(LANGUAGE)
        groups = {"cp_group": language_pgc.cp if language_pgc else None,
                  "tp_group": language_pgc.tp if language_pgc else None}
        if topology.hosted:
            if rng is None:
                raise ValueError("a rank hosting encoders builds them inside their RNG streams: "
                                 "pass rng (ModuleRng.seed)")
            model = colocation.build_presenting_language(mimo_config, topology.hosted, rng.enter,
                                                         **groups)
        else:
            model = MimoModel(mimo_config, **groups)
        context_parallel.split_packed_rows_without_te(model)
        deepstack.install(model, {name: plugin.deepstack_levels
                                  for name, plugin in cfg._plugins.items()})
        return model

    def build_distributed_models(
        self,
        pg_collection: Any = None,
        ddp_config: DistributedDataParallelConfig | None = None,
        overlap_param_gather_with_optimizer_step: bool = False,
        use_megatron_fsdp: bool = False,
        use_torch_fsdp2: bool = False,
        wrap_with_ddp: bool = True,
        data_parallel_random_init: bool = False,
        mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
        model_type: ModelType = ModelType.encoder_or_decoder,
    ) -> list[MimoModel]:
        """Seed, build, wrap and hook up this rank's module; returns ``[mimo_model]``."""
        cfg = self._model_config
        topology = self._topology()
        # Stock pretrain() builds the optimizer next; its checkpoints need these bridges.
        checkpointing.install_checkpoint_bridges(
            context_parallel=any(module.dim_size("cp") > 1 for module in topology.layout.modules),
            colocated=bool(topology.layout.hosted))
        step_reductions.install_step_bridges()
        language = cfg.language.transformer
        if not language.calculate_per_token_loss:
            raise ValueError(
                "MiMo training normalizes every module by one global token count: pass "
                "--calculate-per-token-loss (the MiMo entry point sets it)"
            )
        if use_megatron_fsdp or use_torch_fsdp2:
            raise ValueError("--use-megatron-fsdp / --use-torch-fsdp2 are not supported for "
                             "heterogeneous MiMo yet; use DDP (optionally with "
                             "--use-distributed-optimizer)")
        rng = ModuleRng.seed(topology, cfg.seed, SimpleNamespace(
            data_parallel_random_init=data_parallel_random_init,
            te_rng_tracker=language.use_te_rng_tracker,
            inference_rng_tracker=cfg.inference_rng_tracker,
            cuda_graph_impl=language.cuda_graph_impl,
        ))
        configs = cfg.encoder_configs()
        meta = torch.device("meta") if language.init_model_with_meta_device else None
        with meta or contextlib.nullcontext():
            model = self.build_model(encoder_configs=configs, rng=rng)
        load_pretrained(model, topology.module_pgs, cfg.language_hf_weights,
                        cfg.encoder_hf_weights, cfg._plugins, cfg.hf_model)
        load_megatron_checkpoints(model, topology.module_pgs, cfg.language_megatron_checkpoint,
                                  cfg.encoder_megatron_checkpoints)
        model = _single(compose_hooks(cfg.pre_wrap_hooks)([model]), "pre_wrap_hooks")

        module_pgs = topology.module_pgs
        ddp_configs = {}
        if ddp_config is not None:
            for name in module_pgs:
                overlap = cfg.encoder_overlap_grad_reduce
                if name == LANGUAGE or overlap is None:
                    overlap = ddp_config.overlap_grad_reduce
                ddp_configs[name] = dataclasses.replace(ddp_config, overlap_grad_reduce=overlap)
        prepare_active_modules(
            model, module_pgs, {LANGUAGE: language, **configs}, ddp_configs,
            freeze=Freeze(language_model=cfg.freeze_language_model,
                          encoders=frozenset(cfg.freeze_encoders),
                          projections=frozenset(cfg.freeze_projections)),
            lora=lora_specs(cfg.lora, topology.layout), seed=cfg.seed,
            wrap_with_ddp=wrap_with_ddp, data_parallel_random_init=data_parallel_random_init,
            overlap_param_gather_with_optimizer_step=overlap_param_gather_with_optimizer_step,
        )
        install_grad_sync(model, module_pgs, cfg._alignment)
        omit_frozen_base(model, {part: piece for name in module_pgs
                                 for part, piece in module_parts(model, name).items()
                                 if part in cfg.peft_base})
        part_optimizer.install(cfg.part_settings, model, module_pgs)
        if language.num_moe_experts:
            compat_optimizer.expert_tp_in_grad_norms()
        if topology.layout.hosted:
            colocation.even_optimizer_gathers(topology.layout.most_modules_per_rank)
        if topology.hosted:
            checkpointing.carry_module_rng(rng, module_pgs[LANGUAGE].dp.rank())
            ColocatedEncoders(topology, torch.distributed.get_rank(), {
                name: HostedEncoder(
                    topology.layout.module(name),
                    language.hidden_size * (1 + cfg._plugins[name].deepstack_levels),
                    any(p.requires_grad for p in model.modality_submodules[name].parameters()))
                for name in topology.hosted}, rng,
                recompute=cfg.colocated_encoder_recompute).attach(model)
        # The module stock checkpointing and train_step see: the language model where the rank
        # has it (a colocated rank's encoders keep their RNG streams in ``rng``).
        [active] = [LANGUAGE] if topology.hosted else topology.active_modules
        model.pg_collection = module_pgs[active]
        model.rng_state_key_prefix = rng_state_key_prefix(active)
        return [_single(compose_hooks(cfg.post_wrap_hooks)([model]), "post_wrap_hooks")]


def _single(models: list[MimoModel], hooks: str) -> MimoModel:
    if len(models) != 1 or not isinstance(models[0], MimoModel):
        raise ValueError(f"MimoBuildConfig.{hooks} must return [the MimoModel] (one chunk)")
    return models[0]
