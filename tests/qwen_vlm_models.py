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
from typing import Any

import numpy as np
import torch

from tests.hf_models import built_then, pieces_from
from tests.hf_vision_models import QWEN_PIXELS, QWEN_VISION, qwen_processor, redraw
from tests.hf_vlm_models import ENCODER, cross_grid_forward, vlm_flags, whole_pieces

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
IMAGE_TOKEN = 50
"""The tiny checkpoint's ``<|image_pad|>`` id: inside the vocabulary, below its top."""
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
        text_config=TEXT, image_token_id=IMAGE_TOKEN, tie_word_embeddings=False)
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


def hf_logits(folder: str | Path, ids: torch.Tensor, pictures: list[np.ndarray]) -> np.ndarray:
    """transformers' own forward of the saved Qwen2.5-VL, fp32: its processor's pixel values
    and grids, its own mrope positions (from the image tokens' types)."""
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    inputs = qwen_processor(folder)(pictures, return_tensors="pt")
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=inputs["pixel_values"],
                     image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(ids == IMAGE_TOKEN).int()).logits.numpy()


def _forward_and_stream(session: Any, mimo: Any, ids: torch.Tensor,
                        pictures: list[np.ndarray]) -> dict[str, Any]:
    from megatron_plugins.data.positions import item_layout, mrope_position_ids

    [module] = session.topology.active_modules
    mimo.eval()
    plugin = session.run.plugins[ENCODER]
    preprocessor = plugin.preprocessor()
    inputs = preprocessor.collate([preprocessor(picture) for picture in pictures])
    layouts = [item_layout(plugin, picture.shape[:2]) for picture in pictures]
    token = mimo.special_token_ids[ENCODER]
    positions = mrope_position_ids(ids[0], {token: layouts}).unsqueeze(1)
    logits = cross_grid_forward(mimo, module, session.topology, ids, inputs,
                                sum(count for count, _ in layouts), positions,
                                plugin.deepstack_levels)
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
    from tests.multiprocess import run_in_processes

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
    from tests.hf_models import rel_diff, safetensors_of

    results = forward(nproc, folder, grids, ids, pictures)
    [logits] = [r["logits"] for r in results if r["logits"] is not None]
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
                        mock_positions: bool = False) -> float:
    """transformers' loss on the first ``samples`` mock samples of a run from the folder (the
    first global batch): the mock is a pure function of (seed, split, index), so the same
    source rebuilt here gives the run's tokens, labels, loss mask and images; the loss is the
    masked token loss summed over the batch over its token count, as the run reports it. Any
    whole Qwen folder: its architecture names the transformers class and the encoder provider.
    ``mock_positions``: transformers is given the mock's mrope positions (Qwen3-VL's
    ``get_rope_index`` cannot lay out two image runs side by side, which the mock makes)."""
    import transformers

    from megatron_plugins.data.mock import MockSource
    from megatron_plugins.weights.vlm_families import read_vlm
    from tests.hf_vision_models import plugin

    vlm, _ = read_vlm(str(folder))
    source = MockSource(seed=seed, seq_length=seq_length, vocab_size=VOCAB,
                        plugins={ENCODER: plugin(vlm.encoder_provider, folder)},
                        items_per_sample=items_per_sample, mrope=True,
                        placeholder_ids={ENCODER: IMAGE_TOKEN})
    model = getattr(transformers, vlm.architectures[0]).from_pretrained(folder,
                                                                        dtype=torch.float32)
    processor = qwen_processor(folder)
    total, tokens = 0.0, 0.0
    for index in range(samples):
        text = source.text("train", index)
        ids = text["tokens"].unsqueeze(0)
        pictures = source.media(ENCODER, "train", index)
        inputs = processor(pictures, return_tensors="pt") if pictures else {}
        with torch.no_grad():
            positions = text["position_ids"][:, None] if mock_positions else None
            logits = model(input_ids=ids, pixel_values=inputs.get("pixel_values"),
                           image_grid_thw=inputs.get("image_grid_thw"), position_ids=positions,
                           mm_token_type_ids=(ids == IMAGE_TOKEN).int()).logits[0]
        losses = torch.nn.functional.cross_entropy(logits.double(), text["labels"],
                                                   reduction="none")
        total += float((losses * text["loss_mask"]).sum())
        tokens += float(text["loss_mask"].sum())
    return total / tokens
