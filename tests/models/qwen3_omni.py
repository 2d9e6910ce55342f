"""A tiny random Qwen3-Omni-MoE on disk (its thinker: a 2-layer audio tower in 1-s chunks and
2-s attention windows, a 1-block vision tower, a 1-layer MoE language model; no talker), saved
whole and thinker-only, two clips, transformers' features and audio tower output on them, and
our ``qwen3_omni_audio`` encoder built from the folders.

Every weight is redrawn (biases too), so a mapping that swaps or misses a tensor, or a padded
position that should not be (or should be) zero, changes the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf_vision import redraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RATE = 16000
TEXT_HIDDEN = 24
AUDIO = dict(num_mel_bins=20, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=32,
             d_model=16, n_window=50, n_window_infer=200, downsample_hidden_size=8,
             output_dim=TEXT_HIDDEN)
"""100-frame chunks (the 13 positions transformers counts per chunk need ``n_window`` 50) and
attention windows of two chunks (26 positions), not the class default's eight: so the folder's
config.json, not the class, must shape the tower. 20 mel bins leave 10, 5, 3 after the convs."""
TEXT = dict(vocab_size=64, hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12, moe_intermediate_size=8,
            num_experts=2, num_experts_per_tok=1)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=4,
              out_hidden_size=TEXT_HIDDEN, deepstack_visual_indexes=[0])
CLIPS = (41290, 11690)
"""Samples of the two clips at 16 kHz: 258 mel frames (chunks of 100, 100, 58: 13 + 13 + 8 = 34
positions in windows of 26 and 8) and 73 (one chunk, 10 positions). Both a padded last chunk
(58) and a lone short one (73) have odd lengths after the first conv, so the next conv reads one
position past them: transformers' padding there must be matched."""


def save_tiny(root: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """One tiny random model saved whole (``Qwen3OmniMoeForConditionalGeneration`` without the
    talker: ``thinker.`` names) and thinker-only, each with its Whisper feature extractor."""
    import transformers

    config = transformers.Qwen3OmniMoeConfig(
        thinker_config=dict(audio_config=AUDIO, text_config=TEXT, vision_config=VISION),
        enable_audio_output=False)
    torch.manual_seed(seed)
    model = redraw(transformers.Qwen3OmniMoeForConditionalGeneration(config))
    whole, thinker = Path(root) / "whole", Path(root) / "thinker"
    model.save_pretrained(whole)
    model.thinker.save_pretrained(thinker)
    extractor = transformers.WhisperFeatureExtractor(feature_size=AUDIO["num_mel_bins"],
                                                     sampling_rate=RATE)
    for folder in (whole, thinker):
        extractor.save_pretrained(folder)
    return whole, thinker


def clips(seed: int = 5) -> list[np.ndarray]:
    """The float32 clips of :data:`CLIPS` at 16 kHz: a tone in noise, and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(CLIPS[0]) / RATE
    return [(0.4 * np.sin(2 * np.pi * 660 * t) + 0.05 * rng.standard_normal(t.size)
             ).astype(np.float32),
            (0.3 * rng.standard_normal(CLIPS[1])).astype(np.float32)]


def hf_features(folder: str | Path, clips_: list[np.ndarray]) -> list[np.ndarray]:
    """The Qwen3-Omni processor's features of the clips given together (its audio kwargs on the
    folder's extractor), each kept to its feature attention mask."""
    import transformers
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor,
    )

    extractor = transformers.WhisperFeatureExtractor.from_pretrained(folder)
    out = extractor(clips_, **Qwen3OmniMoeProcessor.audio_kwargs, return_tensors="np")
    return [features[:, :int(mask.sum())]
            for features, mask in zip(out["input_features"], out["attention_mask"])]


def hf_tower(folder: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' ``Qwen3OmniMoeAudioEncoder`` of the folder's config.json with its saved
    tensors (in ``dtype``, eval)."""
    import transformers
    from safetensors.torch import load_file
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    config = transformers.AutoConfig.from_pretrained(folder)
    whole = config.model_type == "qwen3_omni_moe"
    prefix = "thinker.audio_tower." if whole else "audio_tower."
    tensors = {n.removeprefix(prefix): t for n, t in load_file(
        Path(folder) / "model.safetensors").items() if n.startswith(prefix)}
    tower = hf.Qwen3OmniMoeAudioEncoder((config.thinker_config if whole else config
                                         ).audio_config)
    tower.load_state_dict(tensors, strict=True)
    return tower.to(dtype).eval()


def hf_output(folder: str | Path, clips_: list[np.ndarray],
              dtype: torch.dtype = torch.float32) -> np.ndarray:
    """transformers' audio tower output of each clip given alone (processor then tower, the
    processor's float32 features widened to ``dtype``), concatenated: ``[tokens, output_dim]``.
    In float64 the tower's float32 casts stay float64
    (:func:`~tests.harness.gated_delta_net.float64_throughout`; a no-op on float32 tensors)."""
    from tests.harness.gated_delta_net import float64_throughout

    tower = hf_tower(folder, dtype)
    features = [torch.from_numpy(hf_features(folder, [clip])[0]).to(dtype) for clip in clips_]
    with torch.no_grad(), float64_throughout():
        return torch.cat([tower(input_features=f, feature_lens=torch.tensor([f.shape[1]])
                                ).last_hidden_state for f in features]).numpy()


def plugin(folder: str | Path | None, tp: int = 1) -> Any:
    """Our plugin for ``--encoder audio=qwen3_omni_audio --encoder-hf-weights audio=FOLDER``
    (no ``--encoder-hf-weights`` when ``folder`` is None)."""
    from megatron_plugins.encoders import instantiate
    from megatron_plugins.parallel.layout import ModulePlacement

    grid = ModulePlacement(name="audio", tp=tp, pp=1, cp=1, dp=1, rank_offset=0,
                           provider="qwen3_omni_audio")
    args = argparse.Namespace(encoder_hf_weights={} if folder is None else {"audio": str(folder)})
    return instantiate("qwen3_omni_audio", "audio", args, grid)


FLOPS_CASES = (("2 clips: 3 chunks in 2 windows, 1 short chunk", (), ()),
               ("same, encoder frozen", ("encoder",), ()),
               ("same, projection frozen", ("projection",), ()),
               ("same, encoder LoRA after its convolutions and conv_out", (), ("encoder",)))
"""(case, frozen parts, LoRA'd parts) of :func:`flops_rows`."""


def flops_rows(folder: str, cases: tuple = FLOPS_CASES) -> list[Any]:
    """Our encoder and projection on :func:`clips`, forward and backward under FlopCounterMode,
    next to ``item_flops`` (one CPU-simulation rank, its groups made by the FLOPs cases)."""
    from megatron_plugins.media.codec import Waveform
    from tests.harness.flops_cases import _encoder_row

    media = [Waveform(clip, RATE) for clip in clips()]
    return [_encoder_row("qwen3_omni_audio", case, plugin(folder), media, TEXT_HIDDEN, freeze,
                         lora) for case, freeze, lora in cases]


def audio_rank(folder: str, tp: int, clips_: list[np.ndarray]) -> dict[str, Any]:
    """One TP rank of our encoder and projection built from ``folder``, HF weights imported
    through the family: the projected output on the clips (collated by our preprocessor), each
    clip's count, the qkv bias gradients of a backward (key part, the rest) as max magnitudes,
    the streamed HF pieces (serialized); at tp 1 also :func:`flops_rows`."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.media.codec import Waveform
    from megatron_plugins.weights.encoder_view import EncoderView
    from megatron_plugins.weights.flags import ENCODER_FLAG
    from megatron_plugins.weights.hf_import import load_hf_weights
    from tests.harness.flops_cases import _groups
    from tests.models.hf import streamed
    from tests.models.hf_vision import language_config

    if tp == 1:
        pgc = _groups()
    else:
        parallel_state.initialize_model_parallel(tp)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        pgc = ProcessGroupCollection.use_mpu_process_groups()
    encoder = plugin(folder, tp)
    config = encoder.transformer_config(dataclasses.replace(language_config(),
                                                            hidden_size=TEXT_HIDDEN))
    view = EncoderView(build_module(encoder.encoder_spec(config, pgc)),
                       build_module(encoder.projection_spec(config, TEXT_HIDDEN, pgc)))
    family = load_hf_weights(view, folder, f"{ENCODER_FLAG} audio=", pgc, (encoder.hf_family,))
    view.eval()
    preprocessor = encoder.preprocessor()
    inputs = preprocessor.collate([preprocessor(Waveform(clip, RATE)) for clip in clips_])
    output = view.projection(view.encoder(**inputs))
    (output ** 2).sum().backward()
    grads = [layer.self_attention.linear_qkv.bias.grad.view(-1, 3, config.kv_channels)
             for layer in view.encoder.decoder.layers]
    return {"family": family.name, "output": output.detach().numpy(),
            "item_tokens": [encoder.item_tokens((len(clip), RATE)) for clip in clips_],
            "key_bias_grad": max(float(g[:, 1].abs().max()) for g in grads),
            "qv_bias_grad": min(float(g[:, i].abs().max()) for g in grads for i in (0, 2)),
            "pieces": streamed(view, family, pgc, None),
            "flops": flops_rows(folder) if tp == 1 else []}
