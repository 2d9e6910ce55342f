"""A tiny random whole Qwen2.5-VL on disk (a 3-block vision tower with windowed and full
attention, its merger, a 2-layer mrope language model), transformers' logits on a sample of
several images of different sizes, and the same sample through our MiMo model built with
``--hf-model`` (encoder and language on their grids, positions from the data's mrope code).

Its image token is not the vocabulary's top id, so a run on the mock data shows the mock marks
the encoder's positions with the checkpoint's own token.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from tests.models.hf import built_then, pieces_from
from tests.models.hf_vision import QWEN_PIXELS, QWEN_VISION, qwen_processor, redraw
from tests.models.hf_vlm import ENCODER, cross_grid_forward, vlm_flags, whole_pieces

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
IMAGE_TOKEN = 50
"""The tiny checkpoint's ``<|image_pad|>`` id: inside the vocabulary, below its top."""
VIDEO_TOKEN = 51
"""Its ``<|video_pad|>`` id: where transformers puts video features (ours mark videos with the
encoder's token, whose embedding is overwritten just the same)."""
WRAPPING = (52, 53)
"""Its ``<|vision_start|>`` / ``<|vision_end|>`` ids, around every item's run."""
TEXT = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 10000.0})
IMAGES = ((24, 40), (16, 16), (13, 21))
"""(height, width) of the sample's images: wide (two windows across), square, odd-sized."""


def save_tiny_qwen_vl(folder: str | Path, seed: int = 0, **vision: Any) -> Path:
    """A tiny random ``Qwen2_5_VLForConditionalGeneration`` with its preprocessor_config.json,
    every weight redrawn; ``vision`` overrides vision_config fields."""
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        vision_config={**QWEN_VISION, "out_hidden_size": TEXT["hidden_size"], **vision},
        text_config=TEXT, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=WRAPPING[0], vision_end_token_id=WRAPPING[1],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = redraw(transformers.Qwen2_5_VLForConditionalGeneration(config))
    model.save_pretrained(folder)
    qwen_processor(**QWEN_PIXELS).save_pretrained(folder)
    return Path(folder)


def images(seed: int = 3) -> list[np.ndarray]:
    """The sample's uint8 RGB images (:data:`IMAGES`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in IMAGES]


def sample(folder: str | Path, pictures: list[np.ndarray]) -> torch.Tensor:
    """``[1, S]`` ids: text with one ``<|image_pad|>`` run per image, each as long as the
    folder's processor makes that image's merged tokens."""
    grids = qwen_processor(folder)(pictures, return_tensors="pt")["image_grid_thw"]
    runs = [[IMAGE_TOKEN] * (int(grid.prod()) // 4) for grid in grids]
    text = ([5, 17], [42, 8, 61], [23, 3], [9, 30, 12])
    ids = [*text[0], *runs[0], *text[1], *runs[1], *text[2], *runs[2], *text[3]]
    return torch.tensor([ids])


def video_sample(folder: str | Path, items: list[Any]) -> torch.Tensor:
    """``[1, S]`` ids: text with one ``<|image_pad|>`` run per item (image or
    :class:`~megatron_plugins.media.codec.Video`), as long as the encoder's item_tokens, text
    between every two runs."""
    from megatron_plugins.media.codec import media_size
    from tests.models.hf_vision import plugin

    encoder = plugin("qwen2_5_vl", folder)
    ids = [5, 17]
    for index, item in enumerate(items):
        ids += [IMAGE_TOKEN] * encoder.item_tokens(media_size(item)) + [9 + index, 30]
    return torch.tensor([ids])


def _hf_video_inputs(folder: str | Path, ids: torch.Tensor, videos: list[Any]
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' ids, token types and video inputs for a sample whose runs (in order)
    belong to ``videos`` where the item is a video (None: an image): a video's run holds its
    ``<|video_pad|>`` id; its pixel values are our preprocessor's (equal to HF's video
    processor: tests/unit_tests/test_qwen_vision.py)."""
    import itertools

    from tests.models.hf_vision import plugin

    hf_ids, types, start = ids.clone(), (ids == IMAGE_TOKEN).int(), 0
    runs = iter(videos)
    for token, run in itertools.groupby(ids[0].tolist()):
        length = len(list(run))
        if token == IMAGE_TOKEN and next(runs) is not None:
            hf_ids[0, start:start + length] = VIDEO_TOKEN
            types[0, start:start + length] = 2
        start += length
    clips = [video for video in videos if video is not None]
    if not clips:
        return hf_ids, types, {}
    preprocessor = plugin("qwen2_5_vl", folder).preprocessor()
    packed = preprocessor.collate([preprocessor(video) for video in clips])
    span = preprocessor.temporal_patch_size
    return hf_ids, types, {
        "pixel_values_videos": packed["pixel_values"], "video_grid_thw": packed["grid_thw"],
        "second_per_grid_ts": torch.tensor([span / video.fps for video in clips])}


def hf_logits(folder: str | Path, ids: torch.Tensor, pictures: list[Any]) -> np.ndarray:
    """transformers' own forward of the saved Qwen2.5-VL, fp32: its processor's pixel values
    and grids, its own mrope positions (from the tokens' types); a
    :class:`~megatron_plugins.media.codec.Video` among the items goes in as a video."""
    import transformers

    from megatron_plugins.media.codec import Video

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    stills = [item for item in pictures if not isinstance(item, Video)]
    inputs = qwen_processor(folder)(stills, return_tensors="pt") if stills else {}
    hf_ids, types, videos = _hf_video_inputs(
        folder, ids, [item if isinstance(item, Video) else None for item in pictures])
    with torch.no_grad():
        return model(input_ids=hf_ids, pixel_values=inputs.get("pixel_values"),
                     image_grid_thw=inputs.get("image_grid_thw"), mm_token_type_ids=types,
                     **videos).logits.numpy()


def sample_logits(session: Any, mimo: Any, ids: torch.Tensor,
                  pictures: list[np.ndarray]) -> np.ndarray | None:
    """This rank's part of one forward of the sample (``ids`` and its items) over the grids,
    in eval mode, positions from the data's mrope code: the logits on the language's last stage,
    None elsewhere."""
    from megatron_plugins.media.codec import media_size
    from megatron_plugins.data.positions import item_layout, mrope_position_ids

    [module] = session.topology.active_modules
    mimo.eval()
    plugin = session.run.plugins[ENCODER]
    preprocessor = plugin.preprocessor()
    inputs = preprocessor.collate([preprocessor(picture) for picture in pictures])
    layouts = [item_layout(plugin, media_size(picture)) for picture in pictures]
    token = mimo.special_token_ids[ENCODER]
    positions = mrope_position_ids(ids[0], {token: layouts}).unsqueeze(1)
    return cross_grid_forward(mimo, module, session.topology, ids, inputs,
                              sum(count for count, _ in layouts), positions,
                              plugin.deepstack_levels)


def _forward_and_stream(session: Any, mimo: Any, ids: torch.Tensor,
                        pictures: list[np.ndarray]) -> dict[str, Any]:
    logits = sample_logits(session, mimo, ids, pictures)
    return {"logits": logits, "pieces": whole_pieces(mimo, session),
            "special_token_ids": dict(mimo.special_token_ids)}


def forward_rank(argv: list[str], ids: torch.Tensor,
                 pictures: list[np.ndarray]) -> dict[str, Any]:
    """One rank of the MiMo model built from ``--hf-model`` (the entry point's code path): the
    logits on the language's last stage and its streamed HF pieces."""
    return built_then(argv, functools.partial(_forward_and_stream, ids=ids, pictures=pictures))


def forward(nproc: int, folder: str | Path, grids: tuple[str, ...], ids: torch.Tensor,
            pictures: list[np.ndarray]) -> list[dict[str, Any]]:
    """:func:`forward_rank` on ``nproc`` gloo ranks; pieces deserialized."""
    from tests.harness.multiprocess import run_in_processes

    results = run_in_processes(forward_rank, nproc,
                               args=(vlm_flags(folder, grids), ids, pictures),
                               timeout=240, simulated=True)
    for result in results:
        result["pieces"] = pieces_from(result["pieces"])
    return results


def forward_diff(folder: Path, grids: tuple[str, ...], nproc: int, ids: torch.Tensor,
                 pictures: list[np.ndarray], want: np.ndarray) -> float:
    """Our logits' max relative difference from transformers' ``want`` over the grids, after
    checking what every layout must give: zero padded-vocabulary rows, the checkpoint's image
    token marking the images (:data:`VOCAB`, :data:`IMAGE_TOKEN`: the tiny Qwen folders'), and
    every tensor of the folder streamed back unchanged."""
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import rel_diff, safetensors_of

    results = forward(nproc, folder, grids, ids, pictures)
    logits, *others = [r["logits"] for r in results if r["logits"] is not None]
    for other in others:  # each TP rank of the last stage holds the whole logits
        np.testing.assert_array_equal(other, logits)
    assert abs(logits[..., VOCAB:]).max() == 0  # padded vocabulary rows
    for result in results:  # the mock and the model mark images with the checkpoint's token
        assert result["special_token_ids"] == {"image": IMAGE_TOKEN}
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    assert sorted(streamed) == sorted(original)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name
    return rel_diff(logits[..., :VOCAB], want)


def hf_first_batch_loss(folder: str | Path, samples: int, seq_length: int,
                        items_per_sample: tuple[int, int], seed: int,
                        video_frames: int = 0, mock_positions: bool = False) -> float:
    """transformers' loss on the first ``samples`` mock samples of a run from the folder (the
    first global batch): the mock is a pure function of (seed, split, index), so the same
    source rebuilt here gives the run's tokens, labels, loss mask and items (videos too, with
    ``video_frames``; each run between the folder's vision start / end ids where its vocabulary
    holds them, as the run does); the loss is the masked token loss summed over the batch over
    its token count, as the run reports it. Any whole Qwen folder: its architecture names the
    transformers class and the encoder provider. ``mock_positions``: transformers is given the
    mock's mrope positions (Qwen3-VL's ``get_rope_index`` cannot lay out two image runs side by
    side, which the mock makes)."""
    import transformers

    from megatron_plugins.media.codec import Video
    from megatron_plugins.data.mock import MockSource
    from megatron_plugins.weights.flags import checkpoint_item_wrapping
    from megatron_plugins.weights.vlm_families import read_vlm
    from tests.models.hf_vision import plugin

    vlm, _ = read_vlm(str(folder))
    source = MockSource(seed=seed, seq_length=seq_length, vocab_size=VOCAB,
                        plugins={ENCODER: plugin(vlm.encoder_provider, folder)},
                        items_per_sample=items_per_sample, mrope=True,
                        placeholder_ids={ENCODER: IMAGE_TOKEN},
                        wrapping=checkpoint_item_wrapping(SimpleNamespace(
                            hf_model=str(folder), encoder_hf_weights=[f"{ENCODER}={folder}"])),
                        video_frames=video_frames)
    model = getattr(transformers, vlm.architectures[0]).from_pretrained(folder,
                                                                        dtype=torch.float32)
    processor = qwen_processor(folder)
    total, tokens = 0.0, 0.0
    for index in range(samples):
        text = source.text("train", index)
        ids = text["tokens"].unsqueeze(0)
        items = source.media(ENCODER, "train", index)
        stills = [item for item in items if not isinstance(item, Video)]
        inputs = processor(stills, return_tensors="pt") if stills else {}
        hf_ids, types, videos = _hf_video_inputs(
            folder, ids, [item if isinstance(item, Video) else None for item in items])
        with torch.no_grad():
            positions = text["position_ids"][:, None] if mock_positions else None
            logits = model(input_ids=hf_ids, pixel_values=inputs.get("pixel_values"),
                           image_grid_thw=inputs.get("image_grid_thw"), position_ids=positions,
                           mm_token_type_ids=types, **videos).logits[0]
        losses = torch.nn.functional.cross_entropy(logits.double(), text["labels"],
                                                   reduction="none")
        total += float((losses * text["loss_mask"]).sum())
        tokens += float(text["loss_mask"].sum())
    return total / tokens
