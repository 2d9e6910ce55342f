"""Tiny random HF CLIP / SigLIP vision models on disk, and our encoder built from them.

Models are made offline from configs and saved with safetensors. Every weight, norms and embeddings
included, is redrawn so a mapping that swaps or misses a tensor changes the hidden states.
"""

from __future__ import annotations

import argparse
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


def save_tiny(provider: str, folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random HF vision model of ``provider``'s kind saved to ``folder``."""
    import transformers

    config_name, model_name = MODELS[provider]
    config = getattr(transformers, config_name)(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = redraw(getattr(transformers, model_name)(config))
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def redraw(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight redrawn (norm weights near 1, the rest small), from torch's current seed."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model


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

    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, transformer_impl="local",
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        **overrides)


def plugin(provider: str, folder: str | Path, tp: int = 1) -> Any:
    """Our encoder plugin for ``--encoder vision=PROVIDER --encoder-hf-weights vision=FOLDER``."""
    from megatron_plugins.encoders import instantiate
    from megatron_plugins.layout import ModulePlacement

    grid = ModulePlacement(name="vision", tp=tp, pp=1, cp=1, dp=1, rank_offset=0,
                           provider=provider)
    args = argparse.Namespace(encoder_hf_weights=[f"vision={folder}"])
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
    from tests.hf_models import streamed

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
