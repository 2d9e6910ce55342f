"""Tiny random HF Whisper models on disk (1 s chunks at 16 kHz), and our encoder built from them.

Models are made offline from configs and saved with safetensors, with their feature extractor.
Every weight, norms and the position table included, is redrawn so a mapping that swaps or misses
a tensor changes the hidden states.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RATE = 16000
CHUNK_SECONDS = 1
SHAPE = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48,
             decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=24, vocab_size=60,
             num_mel_bins=16, max_source_positions=50, max_target_positions=16,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
"""100 mel frames per 1 s chunk at hop 160 -> 50 positions after the stride-2 conv."""
MODELS = ("WhisperForConditionalGeneration", "WhisperModel", "WhisperEncoder")


def _model_class(name: str) -> Any:
    from transformers.models.whisper import modeling_whisper

    return getattr(modeling_whisper, name)


def save_tiny(folder: str | Path, seed: int = 0, model: str = MODELS[0], **overrides: Any
              ) -> Path:
    """A tiny random HF Whisper ``model`` and its feature extractor saved to ``folder``."""
    import transformers

    config = transformers.WhisperConfig(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    network = _model_class(model)(config)
    with torch.no_grad():
        for name, param in network.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    network.save_pretrained(folder, safe_serialization=True)
    transformers.WhisperFeatureExtractor(
        feature_size=config.num_mel_bins, sampling_rate=RATE,
        chunk_length=CHUNK_SECONDS).save_pretrained(folder)
    return Path(folder)


def waveforms() -> dict[str, np.ndarray]:
    """Clips the features are compared on: short, exactly one chunk, longer (HF cuts it),
    silence, and a loud tone."""
    rng = np.random.default_rng(0)
    t = np.arange(RATE * CHUNK_SECONDS) / RATE
    return {
        "short": (0.3 * rng.standard_normal(2345)).astype(np.float32),
        "full": (0.5 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)
                 ).astype(np.float32),
        "long": (0.2 * rng.standard_normal(RATE * CHUNK_SECONDS + 777)).astype(np.float32),
        "silence": np.zeros(RATE // 2, np.float32),
        "tone": np.sin(2 * np.pi * 3000 * t[:9000]).astype(np.float32),
    }


def hf_features(folder: str | Path, samples: np.ndarray) -> np.ndarray:
    """``WhisperFeatureExtractor.from_pretrained(folder)``'s features of one clip."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    return extractor(samples, sampling_rate=RATE, return_tensors="np")["input_features"][0]


def hf_hidden_states(folder: str | Path, features: np.ndarray) -> np.ndarray:
    """transformers' own encoder ``last_hidden_state`` of the saved model (fp32)."""
    import json

    [name] = json.loads((Path(folder) / "config.json").read_text())["architectures"]
    model = _model_class(name).from_pretrained(folder, dtype=torch.float32)
    encoder = model if name == "WhisperEncoder" else model.get_encoder()
    with torch.no_grad():
        return encoder(torch.from_numpy(features)).last_hidden_state.numpy()


def plugin(folder: str | Path | None, tp: int = 1) -> Any:
    """Our encoder plugin for ``--encoder audio=whisper --encoder-hf-weights audio=FOLDER`` (no
    ``--encoder-hf-weights`` when ``folder`` is None)."""
    from megatron_plugins.encoders import instantiate
    from megatron_plugins.parallel.layout import ModulePlacement

    grid = ModulePlacement(name="audio", tp=tp, pp=1, cp=1, dp=1, rank_offset=0,
                           provider="whisper")
    args = argparse.Namespace(encoder_hf_weights={} if folder is None else {"audio": str(folder)})
    return instantiate("whisper", "audio", args, grid)


def encoder_rank(folder: str, tp: int, features: np.ndarray) -> dict[str, Any]:
    """One TP rank of our encoder built from ``folder`` with its HF weights imported through the
    family table: its output on ``features``, its streamed HF pieces (serialized), and the qkv
    bias gradients of a backward pass (key part, the rest) as max magnitudes."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.weights.flags import ENCODER_FLAG
    from megatron_plugins.weights.hf_import import load_hf_weights
    from tests.models.hf import streamed
    from tests.models.hf_vision import language_config

    parallel_state.initialize_model_parallel(tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    encoder = plugin(folder, tp)
    config = encoder.transformer_config(language_config())
    network = build_module(encoder.encoder_spec(config, pgc))
    family = load_hf_weights(network, folder, f"{ENCODER_FLAG} audio=", pgc, (encoder.hf_family,))
    network.eval()
    output = network(torch.from_numpy(features))
    (output.float() ** 2).sum().backward()
    head_dim = config.kv_channels
    grads = [layer.self_attention.linear_qkv.bias.grad.view(-1, 3, head_dim)
             for layer in network.decoder.layers]
    return {"family": family.name, "output": output.detach().numpy(),
            "tokens_per_item": encoder.tokens_per_item,
            "key_bias_grad": max(float(g[:, 1].abs().max()) for g in grads),
            "qv_bias_grad": min(float(g[:, i].abs().max()) for g in grads for i in (0, 2)),
            "pieces": streamed(network, family, pgc, None)}


def import_error(folder: str) -> str:
    """The one-line error our encoder's import of ``folder`` raises (on one rank)."""
    from megatron_plugins.weights.mapping import HFWeightsError

    features = np.zeros((1, SHAPE["num_mel_bins"], 2 * SHAPE["max_source_positions"]),
                        np.float32)
    try:
        encoder_rank(folder, 1, features)
    except HFWeightsError as error:
        return str(error)
    return "no error"
