"""Tiny random HF CLIP / SigLIP vision models on disk, and our encoder built from them.

Models are made offline from configs and saved with safetensors. Every weight, norms and embeddings
included, is redrawn so a mapping that swaps or misses a tensor changes the hidden states.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             image_size=16, patch_size=4)
MODELS = {
    "clip": ("CLIPVisionConfig", "CLIPVisionModel"),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel"),
}


def redraw(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight redrawn (norm scales around 1), so a swapped or missed tensor shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model


def save_tiny(provider: str, folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random HF vision model of ``provider``'s kind saved to ``folder``."""
    import transformers

    config_name, model_name = MODELS[provider]
    config = getattr(transformers, config_name)(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    redraw(model)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def pixel_values(seed: int = 1, batch: int = 2, size: int = SHAPE["image_size"]) -> np.ndarray:
    """Random normalized pixel values ``[batch, 3, size, size]``."""
    return np.random.default_rng(seed).normal(size=(batch, 3, size, size)).astype(np.float32)


def hf_hidden_states(provider: str, folder: str | Path, pixels: np.ndarray) -> np.ndarray:
    """transformers' own ``last_hidden_state`` of the saved model (fp32)."""
    import transformers

    model = getattr(transformers, MODELS[provider][1]).from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Max absolute difference relative to the largest reference magnitude."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def language_config(**overrides: Any) -> Any:
    """The numerics an encoder copies from the language model, as the CPU simulation sets them."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{
        "num_layers": 1, "hidden_size": 8, "num_attention_heads": 1, "transformer_impl": "local",
        "use_cpu_initialization": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
        "bias_activation_fusion": False, "bias_dropout_fusion": False,
        "persist_layer_norm": False, **overrides})


def plugin(provider: str, folder: str | Path | None, tp: int = 1) -> Any:
    """Our encoder plugin for ``--encoder vision=PROVIDER --encoder-hf-weights vision=FOLDER``
    (no ``--encoder-hf-weights`` when ``folder`` is None)."""
    from megatron_plugins.encoders import instantiate
    from megatron_plugins.parallel.layout import ModulePlacement

    grid = ModulePlacement(name="vision", tp=tp, pp=1, cp=1, dp=1, rank_offset=0,
                           provider=provider)
    args = argparse.Namespace(encoder_hf_weights={} if folder is None else {"vision": str(folder)})
    return instantiate(provider, "vision", args, grid)


def encoder_rank(provider: str, folder: str, tp: int, pixels: np.ndarray) -> dict[str, Any]:
    """One TP rank of our encoder built from ``folder`` with its HF weights imported through the
    family table; returns its output on ``pixels`` and its streamed HF pieces (serialized)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.weights.flags import ENCODER_FLAG
    from megatron_plugins.weights.hf_import import load_hf_weights
    from tests.models.hf import streamed

    parallel_state.initialize_model_parallel(tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    encoder = plugin(provider, folder, tp)
    config = encoder.transformer_config(language_config())
    network = build_module(encoder.encoder_spec(config, pgc))
    family = load_hf_weights(network, folder, f"{ENCODER_FLAG} vision=", pgc,
                             (encoder.hf_family,))
    network.eval()
    with torch.no_grad():
        output = network(torch.from_numpy(pixels))
    return {"family": family.name, "output": output.detach().numpy(),
            "tokens_per_item": encoder.tokens_per_item,
            "pieces": streamed(network, family, pgc, None)}


def save_full_clip(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random full ``CLIPModel`` (text tower too): vision tensors under ``vision_model.``."""
    import transformers

    text = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=8)
    config = transformers.CLIPConfig(text_config=text, vision_config=SHAPE, projection_dim=8)
    torch.manual_seed(seed)
    model = transformers.CLIPModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def full_clip_hidden_states(folder: str | Path, pixels: np.ndarray) -> np.ndarray:
    """The vision tower's ``last_hidden_state`` of a saved full ``CLIPModel``."""
    import transformers

    model = transformers.CLIPModel.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.vision_model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()


def drop_tensor(source: str | Path, target: str | Path, name: str) -> Path:
    """A copy of a single-file HF folder without tensor ``name``."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = Path(target)
    target.mkdir(parents=True)
    shutil.copy(Path(source) / "config.json", target / "config.json")
    tensors = load_file(str(Path(source) / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def import_error(provider: str, folder: str) -> str:
    """The one-line error our encoder's import of ``folder`` raises (on one rank)."""
    from megatron_plugins.weights.mapping import HFWeightsError

    try:
        encoder_rank(provider, folder, 1, pixel_values(batch=1))
    except HFWeightsError as error:
        return str(error)
    return "no error"


QWEN_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                   fullatt_block_indexes=[1])
"""A tiny Qwen2.5-VL vision tower: 2x2-block windows (16 pixels), layer 1 full attention."""
QWEN_TEXT_HIDDEN = 24
QWEN_PIXELS = dict(min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 20)
"""The tiny processor's pixel range (at most 20 merged tokens an image)."""
QWEN_IMAGES = ((24, 40), (16, 16), (50, 30), (13, 21), (7, 9))
"""(height, width) of one packed microbatch: wide, square, one resized down, odd sizes, one
resized up."""


def save_tiny_qwen(folder: str | Path, seed: int = 0, vision_only: bool = False,
                   text_hidden: int = QWEN_TEXT_HIDDEN) -> Path:
    """A tiny random Qwen2.5-VL saved to ``folder`` with a preprocessor_config.json: the whole
    model (``visual.*``, ``model.*``, ``lm_head.*``), or ``vision_only`` its vision model; the
    merger maps to ``text_hidden``, the language model's hidden size."""
    import transformers

    text = dict(vocab_size=64, hidden_size=text_hidden, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 1],
                                 "rope_theta": 10000.0})
    config = transformers.Qwen2_5_VLConfig(
        vision_config={**QWEN_VISION, "out_hidden_size": text_hidden}, text_config=text)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    redraw(model)
    (model.model.visual if vision_only else model).save_pretrained(folder,
                                                                   safe_serialization=True)
    qwen_processor(**QWEN_PIXELS).save_pretrained(folder)
    return Path(folder)


def qwen_processor(folder: str | Path | None = None, **kwargs: Any) -> Any:
    """HF's Qwen2-VL image processor (the PIL class, which our preprocessing equals; with
    torchvision installed ``AutoImageProcessor`` picks the torchvision one): a folder's, or at
    the tiny model's patch sizes."""
    from transformers import Qwen2VLImageProcessorPil

    if folder is not None:
        return Qwen2VLImageProcessorPil.from_pretrained(folder)
    return Qwen2VLImageProcessorPil(patch_size=QWEN_VISION["patch_size"], merge_size=2,
                                    temporal_patch_size=2, **kwargs)


def qwen_images(sizes: tuple[tuple[int, int], ...] = QWEN_IMAGES, seed: int = 0
                ) -> list[np.ndarray]:
    """Random uint8 RGB images of these (height, width)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in sizes]


def qwen_hf_output(folder: str | Path, images: list[np.ndarray]) -> Any:
    """transformers' vision model (fp32; a whole model's ``model.visual``, or the vision model
    a folder holds alone) on the images as the folder's image processor makes them."""
    import transformers

    inputs = qwen_processor(folder)(images, return_tensors="pt")
    config = transformers.AutoConfig.from_pretrained(folder)
    if hasattr(config, "vision_config"):
        visual = transformers.AutoModelForImageTextToText.from_pretrained(
            folder, dtype=torch.float32).model.visual
    else:
        visual = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])


def qwen_hf_features(folder: str | Path, images: list[np.ndarray]) -> np.ndarray:
    """transformers' merged image features (the vision model's ``pooler_output``) of the
    images, as :func:`qwen_hf_output`."""
    return qwen_hf_output(folder, images).pooler_output.numpy()


def preprocessed(provider: str, folder: Path, processor: Any, config: dict[str, Any],
                 images: list[np.ndarray]) -> tuple[dict[str, torch.Tensor], Any]:
    """Our ``provider``'s collated inputs for ``images`` and HF's processor output, the folder's
    preprocessor_config.json replaced by ``processor(**config)``'s (``config`` empty: removed,
    both sides on their defaults, HF's as ``processor()``)."""
    (folder / "preprocessor_config.json").unlink()
    if config:
        processor(**config).save_pretrained(folder)
    preprocessor = plugin(provider, folder).preprocessor()
    got = preprocessor.collate([preprocessor(image) for image in images])
    return got, processor(folder if config else None)(images, return_tensors="pt")


def qwen_rank(folder: str, tp: int, images: list[np.ndarray],
              text_hidden: int = QWEN_TEXT_HIDDEN, provider: str = "qwen2_5_vl") -> dict[str, Any]:
    """One TP rank of our ``provider`` encoder and its projection built from ``folder``, HF
    weights imported through the family table; its projected output on the packed ``images``,
    its token counts and its streamed HF pieces (serialized)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.weights.encoder_view import EncoderView
    from megatron_plugins.weights.flags import ENCODER_FLAG
    from megatron_plugins.weights.hf_import import load_hf_weights
    from tests.models.hf import streamed

    parallel_state.initialize_model_parallel(tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    encoder = plugin(provider, folder, tp)
    language = dataclasses.replace(language_config(), hidden_size=text_hidden)
    config = encoder.transformer_config(language)
    view = EncoderView(build_module(encoder.encoder_spec(config, pgc)),
                       build_module(encoder.projection_spec(config, text_hidden, pgc)))
    family = load_hf_weights(view, folder, f"{ENCODER_FLAG} vision=", pgc, (encoder.hf_family,))
    view.eval()
    preprocessor = encoder.preprocessor()
    inputs = preprocessor.collate([preprocessor(image) for image in images])
    with torch.no_grad():
        output = view.projection(view.encoder(**inputs))
    return {"family": family.name, "output": output.detach().numpy(),
            "item_tokens": [encoder.item_tokens(image.shape[:2]) for image in images],
            "item_grids": [encoder.item_grid(image.shape[:2]) for image in images],
            "tokens_per_item": encoder.tokens_per_item,
            "pieces": streamed(view, family, pgc, None)}


def train_and_export(folder: Path, provider: str, encoder_folder: str | Path,
                     seq_length: int = 32) -> tuple[dict[str, torch.Tensor], Path]:
    """A MiMo run (tiny llama in ``folder / "llama"``) whose encoder ``vision`` (``provider`` at
    encoder TP 2) starts from ``encoder_folder``, trained 2 steps, saved and exported to
    ``folder / "out"``: the live encoder's streamed tensors (assembled) and the export folder."""
    from megatron_plugins.weights.streaming import assemble
    from tests.models import hf as hf_models

    language = hf_models.save_tiny("llama", folder / "llama")
    checkpoint, out = folder / "ckpt", folder / "out"
    encoder = ("--encoder", f"vision={provider}", "--grid", "vision:tp=2",
               "--encoder-hf-weights", f"vision={encoder_folder}")
    pieces, _ = hf_models.train_from_hf(
        3, str(language), "language:", ("--seq-length", str(seq_length),
                                        "--mock-items-per-sample", "1", "--train-iters", "2",
                                        "--save", str(checkpoint), "--save-interval", "2"),
        module="vision", encoder=encoder)
    hf_models.export_checkpoints([(str(checkpoint), str(out), {"progress": False})])
    return assemble(piece for rank in pieces for piece in rank), out


SIGLIP2_SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, patch_size=4, num_patches=16)
"""A tiny NaFlex tower: a 4 x 4 position table, resized up and down to the images' grids."""

SIGLIP2_MAX_PATCHES = 24
"""The tiny tower's image processor's ``max_num_patches`` (above the table's 16 patches)."""


def save_tiny_siglip2(folder: str | Path, seed: int = 0, full: bool = False,
                      **overrides: Any) -> Path:
    """A tiny random HF ``Siglip2VisionModel`` (or a whole ``Siglip2Model``, text tower too) saved
    to ``folder`` with its PIL image processor (``max_num_patches`` :data:`SIGLIP2_MAX_PATCHES`)."""
    import transformers

    vision = {**SIGLIP2_SHAPE, **overrides}
    if full:
        text = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                    num_attention_heads=2, max_position_embeddings=8, projection_size=32)
        config = transformers.Siglip2Config(text_config=text, vision_config=vision)
        model_class = transformers.Siglip2Model
    else:
        config = transformers.Siglip2VisionConfig(**vision)
        model_class = transformers.Siglip2VisionModel
    torch.manual_seed(seed)
    model = model_class(config)
    redraw(model)
    model.save_pretrained(folder, safe_serialization=True)
    transformers.Siglip2ImageProcessorPil(
        patch_size=vision["patch_size"], max_num_patches=SIGLIP2_MAX_PATCHES,
    ).save_pretrained(folder)
    return Path(folder)


def uint8_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A random RGB image ``[height, width, 3]``."""
    return np.random.default_rng(seed + height * width).integers(0, 256, (height, width, 3),
                                                                 np.uint8)


def siglip2_hf(folder: str | Path, images: list[np.ndarray]) -> dict[str, Any]:
    """transformers on ``images``: its processor's output and each image's valid
    ``last_hidden_state`` rows (the padded batch cut to each image's patches)."""
    import transformers

    processor = transformers.Siglip2ImageProcessorPil.from_pretrained(folder)
    inputs = processor(images, return_tensors="pt", input_data_format="channels_last")
    model_class = (transformers.Siglip2Model if "text_config" in
                   transformers.AutoConfig.from_pretrained(folder).to_dict()
                   else transformers.Siglip2VisionModel)
    model = model_class.from_pretrained(folder, dtype=torch.float32)
    tower = model.vision_model if model_class is transformers.Siglip2Model else model
    with torch.no_grad():
        hidden = tower(**inputs).last_hidden_state
    counts = inputs["pixel_attention_mask"].sum(dim=1).tolist()
    return {"inputs": inputs, "counts": counts,
            "hidden": [hidden[i, :n].numpy() for i, n in enumerate(counts)]}


def siglip2_rank(folder: str, tp: int, images: list[np.ndarray]) -> dict[str, Any]:
    """One TP rank of our ``siglip2`` encoder built from ``folder``, HF weights imported through
    its family: its packed output on ``images`` (one microbatch), the token counts it declares
    per image, and its streamed HF pieces (serialized)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.weights.flags import ENCODER_FLAG
    from megatron_plugins.weights.hf_import import load_hf_weights
    from tests.models.hf import streamed

    parallel_state.initialize_model_parallel(tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    encoder = plugin("siglip2", folder, tp)
    config = encoder.transformer_config(language_config())
    network = build_module(encoder.encoder_spec(config, pgc))
    family = load_hf_weights(network, folder, f"{ENCODER_FLAG} vision=", pgc,
                             (encoder.hf_family,))
    preprocessor = encoder.preprocessor()
    batch = preprocessor.collate([preprocessor(image) for image in images])
    network.eval()
    with torch.no_grad():
        output = network(**batch)
    return {"family": family.name, "output": output.detach().numpy(),
            "item_tokens": [encoder.item_tokens(image.shape[:2]) for image in images],
            "pieces": streamed(network, family, pgc, None)}


def assert_streams_back(provider: str, folder: str | Path, results: list[dict[str, Any]]) -> None:
    """The TP ranks' streamed pieces (``results[i]["pieces"]``, fc1 split over tp) reassemble to
    exactly the folder's tensors of the tower."""
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import pieces_from, safetensors_of

    family = plugin(provider, folder).hf_family
    pieces = [piece for result in results for piece in pieces_from(result["pieces"])]
    assert {p.hf_name for p in pieces if "fc1.weight" in p.hf_name and p.tensor.shape[0] < 48}
    assembled = assemble(pieces)
    original = {n: t for n, t in safetensors_of(folder).items() if not family.is_unused(n)}
    assert sorted(assembled) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(assembled[name], tensor), name
