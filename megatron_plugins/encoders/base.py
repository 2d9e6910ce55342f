"""The encoder plugin interface: one class per modality, written in the user's own file if need be.

A plugin declares its flags, builds its Megatron module spec (the encoder network, then a
projection to the language model's hidden size), says how many language-model positions one item
(an image, a clip) fills, and gives the :class:`MediaPreprocessor` that turns one decoded item into
the encoder's inputs and collates a microbatch's items. A sample holds 0..N items per encoder;
an item's token count follows from its size alone (:meth:`EncoderPlugin.item_tokens`), so the
language ranks lay out its placeholder run from the sample's metadata without decoding it. The
MiMo builder, the data module and the layout checks only talk to this interface.
"""

from __future__ import annotations

import abc
import argparse
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from megatron.core.models.mimo.submodules.base import ModalitySubmodules
from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import sharded_state_dict_default

from megatron_plugins.errors import UsageError
from megatron_plugins.flops.count import EncoderFlops, Work
from megatron_plugins.flops.encoder import projection
from megatron_plugins.media.mock import example_size, mock_media
from megatron_plugins.ops import REFERENCE_ATTENTION
from megatron_plugins.ops.fast_attention import bidirectional_layer_spec
from megatron_plugins.parallel.layout import ModulePlacement

__all__ = [
    "EncoderPlugin", "EncoderPluginError", "MediaPreprocessor", "TensorReplicated",
    "encoder_config", "encoder_layer_spec", "encoder_norm", "is_replicated", "mlp_projection_spec"
]

NUMERICS = (
    "fp16", "bf16", "params_dtype", "pipeline_dtype", "autocast_dtype", "use_cpu_initialization",
    "perform_initialization", "init_method_std", "init_model_with_meta_device",
    "calculate_per_token_loss", "attention_dropout", "hidden_dropout",
    "gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion",
    "bias_dropout_fusion", "persist_layer_norm", "deterministic_mode", "transformer_impl",
    "attention_backend", "barrier_with_L1_time", "layernorm_epsilon",
    "attention_softmax_in_fp32", "variable_seq_lengths", "moe_token_dispatcher_type",
    "use_te_rng_tracker",
)
"""TransformerConfig fields an encoder copies from the language model: numerics, not shape."""


def _exact_activation(fields: dict[str, object]) -> dict[str, object]:
    """``fields`` with stock's bias-activation fusion kept only where it computes the activation
    exactly (SwiGLU). Its GELU forms are the tanh approximation: a GELU encoder or projector that
    inherited the language model's fusion (on by default on a GPU, for GELU and SwiGLU models
    alike) would compute another function than its checkpoint's, and than before on the CPU."""
    swiglu = fields.get("activation_func", F.gelu) is F.silu and fields.get("gated_linear_unit")
    if fields.get("bias_activation_fusion") and not swiglu:
        return {**fields, "bias_activation_fusion": False}
    return fields


def mlp_projection_spec(config: TransformerConfig, input_size: int, ffn_hidden_size: int,
                        output_size: int, pg_collection: ProcessGroupCollection | None,
                        **fields: object) -> ModuleSpec:
    """Megatron's ``MultimodalProjector`` MLP (``linear_fc1`` input -> ffn, activation,
    ``linear_fc2`` ffn -> output, biases), column / row parallel on the encoder's TP, with the
    encoder's numerics; ``fields`` override projection config fields (its activation)."""
    projection = TransformerConfig(
        **_exact_activation({**{name: getattr(config, name) for name in NUMERICS}, **fields}),
        # The projector is an MLP: one layer and one head per TP rank only satisfy the checks.
        num_layers=1, hidden_size=output_size, ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=config.tensor_model_parallel_size,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        expert_tensor_parallel_size=config.tensor_model_parallel_size,
    )
    if config.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TERowParallelLinear,
        )

        linears = MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)
    else:
        linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return ModuleSpec(
        module=MultimodalProjector,
        params={"config": projection, "projector_type": "mlp", "input_size": input_size,
                "pg_collection": pg_collection},
        submodules=linears,
    )


class EncoderPluginError(UsageError):
    """An encoder plugin that cannot be used; the message names the flag to fix."""


def encoder_config(language: TransformerConfig, grid: ModulePlacement,
                   **shape: object) -> TransformerConfig:
    """An encoder's TransformerConfig: its own shape (``shape`` fields, which may also override a
    numeric the encoder cannot share, e.g. a fusion its activation has none for) and TP, the
    LM's numerics.

    Copying precision, initialization and per-token-loss settings from the language model is what
    makes encoder gradients mean the same thing as language gradients once they cross the grid
    boundary (DDP scales by 1/dp unless ``calculate_per_token_loss`` is set on *each* module).
    """
    numerics = {name: getattr(language, name) for name in NUMERICS}
    config = TransformerConfig(**_exact_activation({**numerics, **shape}),
                               tensor_model_parallel_size=grid.tp,
                               expert_tensor_parallel_size=grid.tp)
    # Not a field: --reference-attention's choice, for encoder_layer_spec and the towers' specs.
    setattr(config, REFERENCE_ATTENTION, getattr(language, REFERENCE_ATTENTION, False))
    return config


def encoder_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """Megatron's bidirectional (ViT) transformer layer: TE spec when the config uses TE, else
    the local one with the local path's core attention, for unpacked items."""
    return bidirectional_layer_spec(config, packed=False)


def encoder_norm(config: TransformerConfig) -> type:
    """The LayerNorm class matching :func:`encoder_layer_spec`."""
    if config.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.models.vision.vit_layer_specs import LNImpl

    return LNImpl


def is_replicated(spec: ModuleSpec, tp: int) -> bool:
    """Whether an encoder spec at ``tp`` is replicated on its tp ranks rather than sharded: a plain
    ``torch.nn.Module`` class without ``sharded_state_dict`` (``MegatronModule`` has one)."""
    return tp > 1 and isinstance(spec.module, type) and not hasattr(spec.module,
                                                                     "sharded_state_dict")


class TensorReplicated(torch.nn.Module):
    """A plain ``torch.nn.Module`` encoder at tp > 1: every tp rank trains a full copy.

    The tp ranks of a replica get the same inputs and the same seed (same initial weights), and
    the projection's first ``ColumnParallelLinear`` all-reduces its input gradient over tp, so the
    copies receive equal gradients and stay equal. Checkpoints hold one copy: replica ids carry the
    tp rank (stock's default for a plain module uses tp rank 0 on every rank, which the save
    rejects as ``Invalid sharding pattern``); keys are the unwrapped module's, as at tp=1.
    """

    def __init__(self, spec: ModuleSpec, tp_group: torch.distributed.ProcessGroup) -> None:
        super().__init__()
        self.module = build_module(spec)
        self._tp_group = tp_group

    def forward(self, *inputs: object, **kwargs: object) -> object:
        return self.module(*inputs, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """The wrapped module's tensors, replicated over tp and dp."""
        return sharded_state_dict_default(self.module, prefix, sharded_offsets, metadata,
                                          tp_group=self._tp_group)


class MediaPreprocessor(abc.ABC):
    """Turns one decoded sample's media into the encoder's keyword inputs (data side, runs in
    loader workers, so it must pickle: keep plain attributes, no tensors or open handles)."""

    media: ClassVar[str]
    """Which decoded media of a sample it reads: ``"image"`` or ``"audio"``."""

    sample_rate: int | None = None
    """Audio only: the rate the encoder hears (None: any); clips at other rates are resampled to
    it (:func:`megatron_plugins.media.codec.resample`), synthetic audio is made at it."""

    takes_video: ClassVar[bool] = False
    """Image only: it also takes a :class:`megatron_plugins.media.codec.Video` (frames of one
    size) as an item, which a sample gives as a list of frame images."""

    @abc.abstractmethod
    def __call__(self, media: Any) -> dict[str, torch.Tensor]:
        """Keyword inputs of the encoder for one item, without a batch dimension.

        ``media`` is a uint8 ``[H, W, 3]`` RGB ``numpy.ndarray`` (or, with :attr:`takes_video`,
        a :class:`megatron_plugins.media.codec.Video`) for ``"image"`` and a
        :class:`megatron_plugins.media.codec.Waveform` for ``"audio"``. Raise ``ValueError`` for
        media it cannot use; the data source reports it with the sample's key.
        """

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One microbatch's items (at least one, in sample then item order) as the encoder's
        keyword inputs: stacked on a new first dimension. An encoder that takes items of
        different sizes packs them instead (concatenated, with their sizes)."""
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """Its output for one mock sample's media: input shapes without a dataset (benchmarks)."""
        return self(mock_media(self.media, torch.Generator().manual_seed(0), 0,
                               example_size(self.media, self.sample_rate)))


class EncoderPlugin(abc.ABC):
    """One encoder modality of a MiMo model.

    Subclass it, implement the abstract members, and launch with
    ``--encoder NAME=package.module:YourPlugin --grid NAME:tp=...,dp=...``. ``name`` is the
    module name from ``--encoder``; ``grid`` is its parallel split (``grid.tp`` ranks shard it).
    """

    submodules_class: ClassVar[type[ModalitySubmodules]] = VisionModalitySubmodules
    """Megatron's container for this modality's encoder and projection."""

    def __init__(self, name: str, args: argparse.Namespace, grid: ModulePlacement) -> None:
        self.name = name
        self.args = args
        self.grid = grid

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Register this plugin's flags (once per class, shared by encoders of the same class)."""

    @property
    @abc.abstractmethod
    def num_attention_heads(self) -> int:
        """Attention heads of the encoder; the encoder's ``--grid`` tp must divide it."""

    @property
    @abc.abstractmethod
    def tokens_per_item(self) -> int:
        """The most language-model positions one item's output fills (its placeholder run): the
        exact count for an encoder of a fixed input size."""

    def item_tokens(self, size: tuple[int, ...]) -> int:
        """Positions one item of this ``size`` fills (:func:`megatron_plugins.media.codec.
        media_size`: ``(height, width)`` of an image, ``(frames, height, width, fps)`` of a video,
        ``(samples, rate)`` of audio); for an image or audio at most
        :attr:`tokens_per_item`. A pure function of the size: the language ranks call it on
        sizes read from the sample's metadata, the encoder ranks must produce exactly that many."""
        return self.tokens_per_item

    def item_grid(self, size: tuple[int, ...]) -> tuple[Any, ...] | None:
        """The ``(t, h, w)`` layout of an item's language tokens for multimodal RoPE
        (``t * h * w == item_tokens(size)``), a pure function of the size like
        :meth:`item_tokens`; a video's may add a fourth entry, its steps' temporal positions
        from 0 (``t`` floats: :mod:`megatron_plugins.data.positions`). None (the default) gives
        the item's tokens consecutive positions, as text has."""
        return None

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops | None:
        """Forward matmul FLOPs of one item of this ``size`` (as :meth:`item_tokens` takes it)
        through the encoder built on ``config`` and its projection, sorted by what their
        backward computes, so frozen modules count right (:meth:`EncoderFlops.flops`); a pure
        function of the size, composed from :mod:`megatron_plugins.flops.encoder`. A microbatch
        costs the sum of its items'. None (the default): this encoder does not count its FLOPs,
        and throughput leaves it out with a notice rather than a wrong number."""
        return None

    @property
    def counts_flops(self) -> bool:
        """Whether the class counts its items' FLOPs (overrides :meth:`item_flops`)."""
        return type(self).item_flops is not EncoderPlugin.item_flops

    def projection_flops(self, tokens: int, config: TransformerConfig,
                         language_hidden_size: int) -> Work:
        """The work of the default :meth:`projection_spec` over ``tokens`` rows of encoder
        output; a class with another projection overrides both."""
        return projection(tokens, config.hidden_size, language_hidden_size, language_hidden_size,
                          config.transformer_impl)

    @property
    def deepstack_levels(self) -> int:
        """Extra language-width feature levels appended to each token's embedding (the
        projection's output is ``(1 + levels) * language hidden`` wide), which the language
        model adds to its hidden states after its first ``levels`` layers (Qwen3-VL's
        DeepStack); 0 by default."""
        return 0

    text_after_time: ClassVar[bool] = False
    """Whether the text after a video's run starts past its last temporal position too
    (Qwen2.5-Omni's TMRoPE), not only past its rows and columns (Qwen2-VL, Qwen2.5-VL)."""

    @property
    def fixed_item_tokens(self) -> bool:
        """Every item fills :attr:`tokens_per_item` positions, whatever its size; true unless
        the class overrides :meth:`item_tokens` (then override this too where it can be)."""
        return type(self).item_tokens is EncoderPlugin.item_tokens

    @abc.abstractmethod
    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        """The encoder's config; build it with :func:`encoder_config` to share the LM's numerics."""

    @abc.abstractmethod
    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The encoder network; called with a microbatch's items as the preprocessor's
        :meth:`MediaPreprocessor.collate` made them (never with zero items).

        It returns ``[items, tokens_per_item, config.hidden_size]`` (or that flattened to
        ``[items * tokens_per_item, hidden]``); an encoder whose count follows the item size
        returns ``[sum of item_tokens, hidden]``, items in order. ``pg_collection`` is None on
        ranks that never build it.
        """

    @abc.abstractmethod
    def preprocessor(self) -> MediaPreprocessor:
        """What turns one decoded item into this encoder's keyword inputs and collates a
        microbatch's items; the encoder's ``forward(**inputs)`` gets the collated keywords."""

    def projection_spec(self, config: TransformerConfig, language_hidden_size: int,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """A two-layer MLP from the encoder's hidden size to the language model's, sharded on TP."""
        return mlp_projection_spec(config, config.hidden_size, language_hidden_size,
                                   language_hidden_size, pg_collection)

    def submodule_spec(self, config: TransformerConfig, language_hidden_size: int,
                       pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The whole modality for ``MimoModelConfig.modality_submodules_spec``; an encoder that
        cannot be sharded is replicated over its tp ranks (:class:`TensorReplicated`)."""
        encoder = self.encoder_spec(config, pg_collection)
        if is_replicated(encoder, self.grid.tp):
            encoder = ModuleSpec(module=TensorReplicated, params={
                "spec": encoder, "tp_group": pg_collection.tp if pg_collection else None})
        return ModuleSpec(
            module=self.submodules_class,
            params={"pg_collection": pg_collection},
            submodules={
                "encoders": {self.name: encoder},
                "input_projections": [
                    self.projection_spec(config, language_hidden_size, pg_collection)
                ],
            },
        )
