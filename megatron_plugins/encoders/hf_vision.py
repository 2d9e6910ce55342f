"""Pretrained vision encoders (``--encoder NAME=clip``, ``--encoder NAME=siglip``): Megatron's
``CLIPViTModel`` shaped by a HuggingFace vision config so HF weights load into it exactly.

The network is read from ``config.json`` of the folder given as ``--encoder-hf-weights NAME=DIR``
(a ``CLIPVisionModel``/``SiglipVisionModel`` folder, or a ``CLIPModel``/``SiglipModel`` folder whose
``vision_config`` is used); the same flag loads its weights through the ``hf_family`` table
(:mod:`megatron_plugins.weights.vision_families`). The output reaching the projection is HF's ``last_hidden_state``:

- CLIP: class token + patches after the last encoder layer, *before* ``post_layernorm`` (HF only
  normalizes the pooled class token), ``1 + patches`` tokens;
- SigLIP: the patches after ``post_layernorm``, ``patches`` tokens (the attention-pooling head is
  not part of it).

From a whole VLM folder (``--hf-model``, e.g. LLaVA) the output is what the VLM hands its
projector: the ``vision_feature_layer`` hidden states (the tower is built with only the layers
feeding them), the class token dropped for ``vision_feature_select_strategy`` "default"; the
projection uses the projector's activation.

Images are preprocessed as HF's image processor does (``preprocessor_config.json`` when the folder
has one, else the model's defaults), see :class:`HFImagePreprocessor`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from megatron.core.activations import quick_gelu
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import (
    EncoderPlugin,
    EncoderPluginError,
    MediaPreprocessor,
    encoder_config,
)
from megatron_plugins.encoders.hf_source import HFSource
from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, tower
from megatron_plugins.encoders.vit import CLIP_MEAN, CLIP_STD, clip_vit_spec
from megatron_plugins.weights.mapping import Family, HFWeightsError
from megatron_plugins.weights.vision_families import CLIP_VISION, SIGLIP_VISION
from megatron_plugins.weights.vlm_families import FAMILIES as VLM_FAMILIES
from megatron_plugins.weights.vlm_families import HF_MODEL_FLAG

__all__ = ["ACTIVATIONS", "CLIPVisionEncoder", "ClassTokenDropped", "HALF", "HFImagePreprocessor",
           "HFVisionEncoder", "SiglipVisionEncoder", "hf_normalized"]

ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
"""HF ``hidden_act`` values and the Megatron activation computing exactly the same function."""

HALF = (0.5, 0.5, 0.5)
"""SigLIP's per-channel pixel mean and std (RGB, on [0, 1]); CLIP uses the ViT's statistics."""


def hf_normalized(pixels: np.ndarray, rescale_factor: float, mean: tuple[float, ...],
                  std: tuple[float, ...]) -> np.ndarray:
    """uint8 ``[H, W, 3]`` -> float32 ``[H, W, 3]`` as HF's PIL processors make it: rescaled in
    float64 then float32, normalized in float32 (bit for bit)."""
    scaled = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    return (scaled - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


@dataclass(frozen=True)
class HFImagePreprocessor(MediaPreprocessor):
    """HF's PIL image processor for CLIP / SigLIP, step for step: resize (the shortest edge to
    ``shortest_edge`` keeping the aspect ratio, or to ``height`` x ``width``), center crop, rescale
    in float64 then float32, normalize in float32, so pixel values equal HF's bit for bit."""

    media: ClassVar[str] = "image"
    shortest_edge: int | None
    height: int | None
    width: int | None
    crop: tuple[int, int] | None
    resample: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __call__(self, media: np.ndarray) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"x": float32 [3, h, w]}`` (h, w: the model's image size)."""
        image = Image.fromarray(media)
        image = image.resize(self._resized(media.shape[0], media.shape[1]),
                             resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)
        if self.crop is not None:
            crop_h, crop_w = self.crop
            if crop_h > pixels.shape[0] or crop_w > pixels.shape[1]:
                raise ValueError(f"image of {media.shape[1]}x{media.shape[0]} pixels is smaller "
                                 f"than the {crop_w}x{crop_h} crop after resizing")
            top, left = (pixels.shape[0] - crop_h) // 2, (pixels.shape[1] - crop_w) // 2
            pixels = pixels[top:top + crop_h, left:left + crop_w]
        normalized = hf_normalized(pixels, self.rescale_factor, self.mean, self.std)
        return {"x": torch.from_numpy(np.ascontiguousarray(normalized.transpose(2, 0, 1)))}

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        """PIL's (width, height) after the resize step, as HF computes it (int truncation)."""
        if self.shortest_edge is None:
            return self.width, self.height
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        if width <= height:
            return self.shortest_edge, new_long
        return new_long, self.shortest_edge

    @property
    def output_size(self) -> tuple[int, int]:
        """Height and width of the pixel values it makes."""
        if self.crop is not None:
            return self.crop
        if self.shortest_edge is not None:
            return self.shortest_edge, self.shortest_edge
        return self.height, self.width


def _hw(value: Any, where: str) -> tuple[int | None, int | None, int | None]:
    """(shortest_edge, height, width) of an HF ``size``/``crop_size`` field (int or dict)."""
    if isinstance(value, int):
        return value, None, None
    if isinstance(value, dict) and set(value) == {"shortest_edge"}:
        return value["shortest_edge"], None, None
    if isinstance(value, dict) and set(value) == {"height", "width"}:
        return None, value["height"], value["width"]
    raise EncoderPluginError(f"{where} {value!r} is not supported; use "
                             '{"shortest_edge": N} or {"height": H, "width": W}')


class ClassTokenDropped(CLIPViTModel):
    """``CLIPViTModel`` without its class token in the output (LLaVA's "default" feature
    selection); same parameters and names."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, attention_mask)[:, self.class_token_len:]


class HFVisionEncoder(EncoderPlugin):
    """A ViT whose shape, weights and preprocessing come from one HF model folder; subclasses
    name the HF model (``provider``, ``model_type``, Megatron ``subtype``, preprocessing defaults)."""

    provider: ClassVar[str]
    model_type: ClassVar[str]
    """The vision config's ``model_type``; a full model's config carries it as ``vision_config``."""
    subtype: ClassVar[str]
    class_token: ClassVar[bool]
    default_mean: ClassVar[tuple[float, float, float]]
    default_std: ClassVar[tuple[float, float, float]]
    default_crop: ClassVar[bool]
    hf_family: ClassVar[Family]
    """The weight mapping ``--encoder-hf-weights`` imports through."""
    unsupported_preprocessing: ClassVar[tuple[str, ...]] = ("do_pad", "do_image_splitting")
    """preprocessor_config.json flags whose steps it does not take, refused when true."""

    def __init__(self, name: str, args: argparse.Namespace, grid: Any) -> None:
        super().__init__(name, args, grid)
        source = HFSource.of(name, self.provider, args, f"a HF {self.model_type} folder")
        self.folder, self.where, self.source = source.folder, source.where, source
        self.hf_config = self._read_config()
        self.layers, self.drops_class_token, self.projector_act = self._feature_selection()
        self._preprocessor = self._read_preprocessor()

    def _feature_selection(self) -> tuple[int, bool, str | None]:
        """(tower layers built, class token dropped, projector activation): a whole VLM folder's
        feature selection, else the whole tower's last hidden state and the default projection."""
        config = self._read_json("config.json")
        architectures = set(config.get("architectures") or [])
        vlm = next((f for f in VLM_FAMILIES if architectures & set(f.architectures)), None)
        if vlm is None:
            return self.hf_config.num_hidden_layers, False, None
        act = vlm.projector_activation(config)
        if act not in ACTIVATIONS:
            raise EncoderPluginError(f"{self.where}: projector activation {act!r} is not "
                                     f"supported; supported: {', '.join(ACTIVATIONS)}")
        try:
            layers, drops = vlm.tower_layers(config), vlm.drops_class_token(config)
        except HFWeightsError as error:
            raise EncoderPluginError(f"{HF_MODEL_FLAG} {self.folder}: {error}") from None
        if drops and not self.class_token:
            raise EncoderPluginError(f"{HF_MODEL_FLAG} {self.folder}: the feature selection "
                                     "drops a class token this tower does not have")
        return layers, drops, act

    def _read_json(self, filename: str) -> dict[str, Any] | None:
        return self.source.read_json(filename)

    def _read_config(self) -> Any:
        """The HF vision config object (HF's own defaults fill fields the file leaves out)."""
        config = self._read_json("config.json")
        if config is None:
            raise EncoderPluginError(f"{self.where}: no config.json; give a "
                                     f"folder saved by save_pretrained")
        vision = config.get("vision_config", config)
        model_type = vision.get("model_type", self.model_type if "vision_config" in config
                                else config.get("model_type"))
        if model_type != self.model_type:
            raise EncoderPluginError(
                f"{self.where}: config.json is a {model_type!r} model, not "
                f"{self.model_type!r}; use the provider matching the model")
        fields = {key: value for key, value in vision.items() if key != "model_type"}
        hf_config = self.source.hf_config(self.model_type, fields)
        act = hf_config.hidden_act
        if act not in ACTIVATIONS:
            raise EncoderPluginError(f"{self.where}: hidden_act {act!r} is "
                                     f"not supported; supported: {', '.join(ACTIVATIONS)}")
        self._check_shape(hf_config)
        return hf_config

    def _check_shape(self, hf_config: Any) -> None:
        """Refuse a vision config whose image geometry the encoder cannot build."""
        if hf_config.num_channels != 3 or hf_config.image_size % hf_config.patch_size:
            raise EncoderPluginError(
                f"{self.where}: need num_channels 3 and image_size divisible "
                f"by patch_size (got {hf_config.num_channels}, {hf_config.image_size}, "
                f"{hf_config.patch_size})")

    def _read_preprocessor(self) -> HFImagePreprocessor:
        """preprocessor_config.json's recipe (or the model's defaults); its output must be the
        model's image size."""
        where = f"{self.where}: preprocessor_config.json"
        size = self.hf_config.image_size
        config = self._read_json("preprocessor_config.json") or {}
        for flag in self.unsupported_preprocessing:
            if config.get(flag):
                raise EncoderPluginError(f"{where} {flag} is not supported; set it false")
        shortest, height, width = _hw(config.get("size", size if self.default_crop
                                                 else {"height": size, "width": size}),
                                      f"{where} size")
        crop = None
        if config.get("do_center_crop", self.default_crop):
            crop_edge, crop_h, crop_w = _hw(config.get("crop_size", size), f"{where} crop_size")
            crop = (crop_edge, crop_edge) if crop_edge is not None else (crop_h, crop_w)
        mean = config.get("image_mean", self.default_mean)
        std = config.get("image_std", self.default_std)
        if not config.get("do_normalize", True):
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        if not config.get("do_resize", True) or not config.get("do_rescale", True):
            raise EncoderPluginError(f"{where} do_resize and do_rescale false are not supported")
        preprocessor = HFImagePreprocessor(
            shortest_edge=shortest, height=height, width=width, crop=crop,
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std))
        if preprocessor.output_size != (size, size):
            raise EncoderPluginError(f"{where} makes {preprocessor.output_size} images but the "
                                     f"model's image_size is {size}; fix size / crop_size")
        return preprocessor

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def tokens_per_item(self) -> int:
        patches = (self.hf_config.image_size // self.hf_config.patch_size) ** 2
        return patches + int(self.class_token and not self.drops_class_token)

    def item_flops(self, size: tuple[int, ...], config: TransformerConfig,
                   language_hidden_size: int) -> EncoderFlops:
        """The patch embedding, the built layers over the patches (and the class token), the
        projection over the tokens that reach it (the class token dropped or not)."""
        patch, tokens = self.hf_config.patch_size, self.item_tokens(size)
        patches = tokens - int(self.class_token and not self.drops_class_token)
        return EncoderFlops(embedding(patches, 3 * patch * patch, config.hidden_size)
                            + tower(config, [patches + int(self.class_token)]),
                            self.projection_flops(tokens, config, language_hidden_size))

    def transformer_config(self, language: TransformerConfig) -> TransformerConfig:
        hf = self.hf_config
        # The HF model's own eps (given here: dataclasses.replace would drop the
        # --reference-attention choice); encoder_config keeps its GELU forms unfused.
        return encoder_config(
            language, self.grid, num_layers=self.layers, hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
            activation_func=ACTIVATIONS[hf.hidden_act], add_bias_linear=True, add_qkv_bias=True,
            layernorm_epsilon=hf.layer_norm_eps)

    def encoder_spec(self, config: TransformerConfig,
                     pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        spec = clip_vit_spec(config, pg_collection, patch_size=self.hf_config.patch_size,
                             image_size=self.hf_config.image_size, subtype=self.subtype,
                             class_token=self.class_token)
        if self.drops_class_token:
            spec = dataclasses.replace(spec, module=ClassTokenDropped)
        return spec

    def projection_spec(self, config: TransformerConfig, language_hidden_size: int,
                        pg_collection: ProcessGroupCollection | None) -> ModuleSpec:
        """The MLP projection; a whole VLM's with its projector's activation."""
        spec = super().projection_spec(config, language_hidden_size, pg_collection)
        if self.projector_act is None:
            return spec
        projection = dataclasses.replace(spec.params["config"],
                                         activation_func=ACTIVATIONS[self.projector_act])
        return dataclasses.replace(spec, params={**spec.params, "config": projection})

    def preprocessor(self) -> HFImagePreprocessor:
        return self._preprocessor


class CLIPVisionEncoder(HFVisionEncoder):
    """HF ``CLIPVisionModel``: class token, ``pre_layrnorm``, quick_gelu, no conv bias."""

    provider = "clip"
    model_type = "clip_vision_model"
    subtype = "clip"
    class_token = True
    default_mean, default_std, default_crop = CLIP_MEAN, CLIP_STD, True
    hf_family = CLIP_VISION


class SiglipVisionEncoder(HFVisionEncoder):
    """HF ``SiglipVisionModel``: no class token, ``post_layernorm``, gelu (tanh), conv bias."""

    provider = "siglip"
    model_type = "siglip_vision_model"
    subtype = "siglip"
    class_token = False
    default_mean, default_std, default_crop = HALF, HALF, False
    hf_family = SIGLIP_VISION
