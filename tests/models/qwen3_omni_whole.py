"""A tiny random whole Qwen3-Omni-MoE on disk (thinker: a 3-block Qwen3-VL-MoE vision tower with
two DeepStack levels, :mod:`tests.models.qwen3_omni`'s 2-layer AuT audio tower, a 4-layer
Qwen3-MoE language model with interleaved multimodal RoPE; a 1-layer talker and code2wav carried
beside it), a sample of two images, two clips and a video with its sound, transformers' thinker
logits on it and its first-batch loss; our run over the grids is
:mod:`tests.models.qwen_omni`'s (``forward_diff``), which serves any Omni folder.

Every weight is redrawn so a mapping that swaps or misses a tensor changes the outputs. Its token
ids lie inside the tiny vocabulary, below its top; the vision start / end ids sit in the talker
config only (the thinker config's class has no such field), so transformers' ``get_rope_index``
must be given them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf_vision import QWEN_PIXELS, redraw
from tests.models.qwen3_omni import AUDIO, RATE, TEXT_HIDDEN, clips
from tests.models.qwen3_vlm import VISION as QWEN3_VISION
from tests.models.qwen3_vlm import processor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = 50, 51, 52
AUDIO_WRAPPING = (53, 54)
"""``<|audio_start|>`` / ``<|audio_end|>`` around every clip's run (the thinker config's)."""
VISION_WRAPPING = (55, 56)
"""``<|vision_start|>`` / ``<|vision_end|>`` around every image's run (the talker config's)."""
TEXT = dict(vocab_size=VOCAB, hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12, moe_intermediate_size=8,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "mrope_interleaved": True, "rope_theta": 10000.0})
"""Four layers: the first pipeline stage of two holds both DeepStack layers; four experts, two
per token (renormalized), so EP 2 holds two each."""
VISION = {**QWEN3_VISION, "out_hidden_size": TEXT_HIDDEN}
POSITIONS_PER_SECOND = 13
"""The released folders' ``position_id_per_seconds`` (the class default is 25)."""


def _talker_and_code2wav() -> dict[str, Any]:
    """A 1-layer talker (its MoE with a shared expert, its code predictor) and code2wav."""
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True,
            "rope_theta": 10000.0}
    text = dict(vocab_size=40, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                moe_intermediate_size=8, num_experts=2, num_experts_per_tok=1,
                shared_expert_intermediate_size=8, rope_parameters=rope)
    predictor = dict(vocab_size=40, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_code_groups=2)
    talker = dict(text_config=text, code_predictor_config=predictor, num_code_groups=2,
                  thinker_hidden_size=TEXT_HIDDEN, accept_hidden_layer=1, spatial_merge_size=2,
                  audio_token_id=AUDIO_TOKEN, image_token_id=IMAGE_TOKEN,
                  video_token_id=VIDEO_TOKEN, audio_start_token_id=AUDIO_WRAPPING[0],
                  vision_start_token_id=VISION_WRAPPING[0],
                  vision_end_token_id=VISION_WRAPPING[1],
                  position_id_per_seconds=POSITIONS_PER_SECOND)
    code2wav = dict(codebook_size=40, hidden_size=16, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=16, num_hidden_layers=1,
                    num_quantizers=2, upsample_rates=[2], upsampling_ratios=[2], decoder_dim=16,
                    sliding_window=8)
    return {"talker_config": talker, "code2wav_config": code2wav}


def save_tiny_qwen3_omni(folder: str | Path, seed: int = 0, thinker_only: bool = False,
                         **text: Any) -> Path:
    """A tiny random ``Qwen3OmniMoeForConditionalGeneration`` (or its thinker alone) with a
    preprocessor_config.json holding the image processor's and the feature extractor's fields,
    as the released folder's does; ``text`` overrides :data:`TEXT` fields."""
    import transformers

    thinker = dict(text_config={**TEXT, **text}, vision_config=VISION, audio_config=AUDIO,
                   audio_token_id=AUDIO_TOKEN, image_token_id=IMAGE_TOKEN,
                   video_token_id=VIDEO_TOKEN, audio_start_token_id=AUDIO_WRAPPING[0],
                   audio_end_token_id=AUDIO_WRAPPING[1],
                   position_id_per_seconds=POSITIONS_PER_SECOND)
    config = transformers.Qwen3OmniMoeConfig(thinker_config=thinker, **_talker_and_code2wav())
    torch.manual_seed(seed)
    model = redraw(transformers.Qwen3OmniMoeForConditionalGeneration(config))
    folder = Path(folder)
    (model.thinker if thinker_only else model).save_pretrained(folder)
    processor(**QWEN_PIXELS).save_pretrained(folder)
    path = folder / "preprocessor_config.json"
    extractor = transformers.WhisperFeatureExtractor(feature_size=AUDIO["num_mel_bins"],
                                                     sampling_rate=RATE)
    path.write_text(json.dumps({**json.loads(path.read_text()), **extractor.to_dict()},
                               indent=2))
    return folder


VIDEO_FPS = 1.998
"""The sample's video runs at a 29.97-fps file's rate as sampled at 2 a second: its steps 13.01
positions apart, every position after it fractional."""
IMAGE_SIZES = ((24, 40), (16, 16))
"""(height, width) of the sample's two images."""


def images(seed: int = 3) -> list[np.ndarray]:
    """The sample's uint8 RGB images (:data:`IMAGE_SIZES`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in IMAGE_SIZES]


def media() -> dict[str, list[Any]]:
    """The sample's items per encoder ``--hf-model`` makes of the folder: its images and its
    video (:func:`tests.models.qwen_omni.video`: 3 steps 13.01 positions apart), then its clips
    (:func:`tests.models.qwen3_omni.clips`: 258 and 73 mel frames) and the video's sound."""
    from megatron_plugins.media.codec import Waveform
    from tests.models.qwen_omni import sound, video

    return {"image": [*images(), video(VIDEO_FPS)],
            "audio": [Waveform(clip, RATE) for clip in (*clips(), sound())]}


def _hf_video(folder: str | Path) -> dict[str, torch.Tensor]:
    """transformers' video processor (Qwen2-VL's, as Qwen3-Omni's processor) on the sample's
    video, its frames as they are."""
    import transformers

    from tests.models.qwen_omni import video

    return transformers.Qwen2VLVideoProcessor.from_pretrained(folder)(
        videos=[video().frames], do_sample_frames=False, return_tensors="pt")


def sample(folder: str | Path) -> torch.Tensor:
    """``[1, S]`` ids as the Omni processor lays them out: text, each image's run between the
    vision start / end ids, each clip's between the audio start / end ids, as long as HF makes
    them, and the video with its sound merged by time (``use_audio_in_video``)."""
    from tests.models.qwen3_omni import plugin
    from tests.models.qwen_omni import SOUND_SAMPLES, video_with_sound_ids

    grids = processor(folder)(images(), return_tensors="pt")["image_grid_thw"]
    image_runs = [[VISION_WRAPPING[0], *[IMAGE_TOKEN] * (int(g.prod()) // 4), VISION_WRAPPING[1]]
                  for g in grids]
    audio = plugin(folder)
    audio_runs = [[AUDIO_WRAPPING[0], *[AUDIO_TOKEN] * audio.item_tokens((len(clip), RATE)),
                   AUDIO_WRAPPING[1]] for clip in clips()]
    composite = video_with_sound_ids(_hf_video(folder)["video_grid_thw"][0], 2 / VIDEO_FPS,
                                     audio.item_tokens((SOUND_SAMPLES, RATE)),
                                     "Qwen3OmniMoeProcessor", POSITIONS_PER_SECOND)
    return torch.tensor([[5, 17, *image_runs[0], 42, 8, *audio_runs[0], 23, *image_runs[1], 9,
                          30, *audio_runs[1], 12, *composite, 3, 4]])


def hf_thinker(folder: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' thinker of the folder (in ``dtype``, eval; in float64 its experts looped,
    as its grouped matmul has no float64), given the vision start id its config lacks (its
    ``get_rope_index`` finds the images' starts by it)."""
    import transformers

    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        folder, dtype=dtype, **experts)
    model.config.vision_start_token_id = VISION_WRAPPING[0]
    return model.eval()


def hf_thinker_forward(model: Any, folder: str | Path, ids: torch.Tensor,
                       pictures: list[np.ndarray], sounds: list[np.ndarray],
                       film: bool = False) -> torch.Tensor:
    """The thinker's logits on one sample, in the model's dtype (float64: its float32 casts
    inside, norms' and rotary's, kept float64 by
    :func:`~tests.harness.gated_delta_net.float64_throughout`, a no-op on float32 tensors): its
    image inputs, each clip's audio features as transformers computes a clip given alone
    (:func:`tests.models.qwen3_omni.hf_output`: a batch would pad the shorter clip's waveform
    and chunks), its ``get_rope_index`` positions (each clip's mel frames), its DeepStack; with
    ``film``, the sample's video too, its sound the last of ``sounds`` (``use_audio_in_video``)."""
    from tests.harness.gated_delta_net import float64_throughout
    from tests.models.qwen3_omni import hf_features, hf_output

    inputs = processor(folder)(pictures, return_tensors="pt") if pictures else {}
    video = _hf_video(folder) if film else {}
    pixels, moving = inputs.get("pixel_values"), video.get("pixel_values_videos")
    embeds = model.get_input_embeddings()(ids).detach()
    frames = None
    if sounds:
        embeds[ids == AUDIO_TOKEN] = torch.from_numpy(hf_output(folder, sounds, model.dtype))
        frames = torch.tensor([hf_features(folder, [clip])[0].shape[1] for clip in sounds])
    with torch.no_grad(), float64_throughout():
        positions, _ = model.model.get_rope_index(
            ids, inputs.get("image_grid_thw"), video.get("video_grid_thw"), torch.ones_like(ids),
            film, frames, torch.tensor([2 / VIDEO_FPS]) if film else None)  # 2 frames a step
        return model(input_ids=ids, inputs_embeds=embeds, position_ids=positions,
                     pixel_values=None if pixels is None else pixels.to(model.dtype),
                     image_grid_thw=inputs.get("image_grid_thw"),
                     pixel_values_videos=None if moving is None else moving.to(model.dtype),
                     video_grid_thw=video.get("video_grid_thw")).logits


def hf_thinker_logits(folder: str | Path, ids: torch.Tensor) -> np.ndarray:
    """transformers' thinker on the sample (:func:`hf_thinker_forward`, the video and its sound
    included) in float64: the exact reference for our float32 run."""
    from tests.models.qwen_omni import sound

    return hf_thinker_forward(hf_thinker(folder, torch.float64), folder, ids, images(),
                              [*clips(), sound()], film=True).numpy()


def hf_first_batch_loss(folder: str | Path, samples: int, seq_length: int,
                        items_per_sample: tuple[int, int], seed: int) -> float:
    """:func:`tests.models.qwen_omni.first_batch_loss` of transformers' Qwen3-Omni thinker
    (:func:`hf_thinker_forward`)."""
    from tests.models.qwen_omni import first_batch_loss

    model = hf_thinker(folder)

    def logits(ids: torch.Tensor, items: dict[str, list[Any]]) -> torch.Tensor:
        return hf_thinker_forward(model, folder, ids, items["image"],
                                  [clip.samples for clip in items["audio"]])[0]

    return first_batch_loss(folder, samples, seq_length, items_per_sample, seed, logits)
