"""A tiny random whole Qwen2.5-Omni on disk (thinker: a 2-layer audio tower in 2-chunk windows,
a 2-block Qwen2.5-VL vision tower, a 2-layer mrope Qwen2; a 1-layer talker and token2wav carried
beside it, and a ``spk_dict.pt``), clips of different lengths, and transformers' audio features
and logits on them.

Every weight is redrawn so a mapping that swaps or misses a tensor changes the outputs. Its
token ids lie inside the tiny vocabulary, below its top.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf_vision import QWEN_PIXELS, QWEN_VISION, qwen_processor, redraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = 50, 51, 52
AUDIO_WRAPPING = (53, 54)
"""``<|audio_bos|>`` / ``<|audio_eos|>`` around every clip's run."""
VISION_WRAPPING = (55, 56)
"""``<|vision_bos|>`` / ``<|vision_eos|>`` around every image's run (the talker config's ids)."""
RATE = 16000
MEL_BINS = 16
TEXT = dict(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 10000.0})
AUDIO = dict(num_mel_bins=MEL_BINS, encoder_layers=2, encoder_attention_heads=2,
             encoder_ffn_dim=32, d_model=16, max_source_positions=1500, n_window=25,
             output_dim=TEXT["hidden_size"])
"""Chunks of 50 mel frames (0.5 s), so the clips below span two to four chunks."""
CLIPS = (13000, 21111)
"""Samples of the sample's two clips at 16 kHz: 82 and 132 mel frames, 20 and 33 tokens."""


def _talker_and_token2wav() -> dict[str, Any]:
    talker = dict(vocab_size=40, embedding_size=TEXT["hidden_size"], hidden_size=16,
                  intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, audio_token_index=AUDIO_TOKEN,
                  image_token_index=IMAGE_TOKEN, video_token_index=VIDEO_TOKEN,
                  vision_start_token_id=VISION_WRAPPING[0], vision_end_token_id=VISION_WRAPPING[1],
                  audio_start_token_id=AUDIO_WRAPPING[0], audio_end_token_id=AUDIO_WRAPPING[1],
                  rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                   "rope_theta": 10000.0})
    dit = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8, ff_mult=1,
               emb_dim=8, enc_emb_dim=8, enc_dim=8, mel_dim=8, num_embeds=40, repeats=2,
               enc_channels=[8, 8, 8, 8, 24], enc_kernel_sizes=[5, 3, 3, 3, 1],
               enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=2,
               enc_se_channels=8, block_size=4, look_ahead_layers=[0], look_backward_layers=[0])
    bigvgan = dict(mel_dim=8, upsample_initial_channel=16, resblock_kernel_sizes=[3],
                   resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[2],
                   upsample_kernel_sizes=[4])
    return {"talker_config": talker,
            "token2wav_config": {"dit_config": dit, "bigvgan_config": bigvgan}}


def save_tiny_omni(folder: str | Path, seed: int = 0, thinker_only: bool = False) -> Path:
    """A tiny random ``Qwen2_5OmniForConditionalGeneration`` (or its thinker alone) with a
    preprocessor_config.json holding the image processor's and the feature extractor's fields,
    as the released folder's does, and (whole model) a ``spk_dict.pt``."""
    import transformers

    thinker = dict(text_config=TEXT, audio_config=AUDIO,
                   vision_config={**QWEN_VISION, "out_hidden_size": TEXT["hidden_size"]},
                   audio_token_index=AUDIO_TOKEN, image_token_index=IMAGE_TOKEN,
                   video_token_index=VIDEO_TOKEN, audio_start_token_id=AUDIO_WRAPPING[0],
                   audio_end_token_id=AUDIO_WRAPPING[1])
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker, **_talker_and_token2wav())
    torch.manual_seed(seed)
    model = redraw(transformers.Qwen2_5OmniForConditionalGeneration(config))
    folder = Path(folder)
    if thinker_only:
        model.thinker.save_pretrained(folder)
    else:
        model.save_pretrained(folder)
        torch.save({"speaker": {"cond": torch.arange(4.0)}}, folder / "spk_dict.pt")
    qwen_processor(**QWEN_PIXELS).save_pretrained(folder)
    path = folder / "preprocessor_config.json"
    extractor = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=RATE)
    path.write_text(json.dumps({**json.loads(path.read_text()), **extractor.to_dict()},
                               indent=2))
    return folder


def clips(seed: int = 5) -> list[np.ndarray]:
    """The sample's float32 clips at 16 kHz (:data:`CLIPS`): noise and a tone."""
    rng = np.random.default_rng(seed)
    t = np.arange(CLIPS[1]) / RATE
    return [(0.3 * rng.standard_normal(CLIPS[0])).astype(np.float32),
            (0.4 * np.sin(2 * np.pi * 660 * t) + 0.05 * rng.standard_normal(t.size)
             ).astype(np.float32)]


def hf_audio_inputs(clips_: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """The Omni processor's audio inputs: Whisper features padded to 30 s (``max_length``) and
    the feature attention mask."""
    import transformers

    extractor = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=RATE)
    out = extractor(clips_, sampling_rate=RATE, padding="max_length", return_attention_mask=True,
                    return_tensors="pt")
    return {"input_features": out["input_features"],
            "feature_attention_mask": out["attention_mask"]}


VIDEO_FRAMES = 6
"""The sample's video: 6 frames of 32 x 32 at 2 per second (3 temporal steps of 1 s: time
positions 0, 25, 50, so two 2-s chunks), with a 3-s sound track (75 tokens, two chunks)."""
SOUND_SAMPLES = 48000


def video(fps: float = 2.0) -> Any:
    """The sample's :class:`~megatron_plugins.media.codec.Video` (2 frames per second unless
    given)."""
    from megatron_plugins.media.codec import Video

    rng = np.random.default_rng(7)
    return Video(rng.integers(0, 256, (VIDEO_FRAMES, 32, 32, 3), np.uint8), fps)


def sound() -> np.ndarray:
    """The video's float32 sound track at 16 kHz: a falling tone in noise."""
    rng = np.random.default_rng(8)
    t = np.arange(SOUND_SAMPLES) / RATE
    return (0.3 * np.sin(2 * np.pi * (500 - 60 * t) * t)
            + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def video_with_sound_ids(grid_thw: torch.Tensor, second_per_grid: float,
                         sound_tokens: int, processor_class: str = "Qwen2_5OmniProcessor",
                         position_id_per_seconds: float = 25) -> list[int]:
    """transformers' processor's run of a video with its sound (``replace_video_with_audio_
    token``: ``<|audio_bos|>``, per 2-s chunk the video's then the sound's tokens (Qwen3-Omni's
    ``processor_class``: merged by time), ``<|audio_eos|>``) between the vision bos / eos, the
    video tokens as ``<|VIDEO|>``."""
    import functools
    from types import SimpleNamespace

    import transformers

    processor = getattr(transformers, processor_class)
    layout = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2), video_token="V",
                             audio_token="A", audio_bos_token="<", audio_eos_token=">")
    layout.get_chunked_index = functools.partial(processor.get_chunked_index, layout)
    text = processor.replace_video_with_audio_token(
        layout, {"video_grid_thw": [grid_thw], "video_second_per_grid": [second_per_grid]}, 0,
        {"num_audio_tokens": [sound_tokens]}, 0, position_id_per_seconds=position_id_per_seconds,
        seconds_per_chunk=2.0)
    by_char = {"V": VIDEO_TOKEN, "A": AUDIO_TOKEN, "<": AUDIO_WRAPPING[0],
               ">": AUDIO_WRAPPING[1]}
    return [VISION_WRAPPING[0], *[by_char[c] for c in text], VISION_WRAPPING[1]]


def _video_inputs(folder: str | Path) -> dict[str, torch.Tensor]:
    """The video's pixel values and grid as our preprocessor makes them (equal to transformers'
    video processor: tests/unit_tests/test_qwen_vision.py)."""
    from tests.models.hf_vision import plugin

    preprocessor = plugin("qwen2_5_omni_vision", folder).preprocessor()
    return preprocessor.collate([preprocessor(video())])


IMAGE_SIZES = ((24, 40), (16, 16))
"""(height, width) of the sample's two images."""


def images(seed: int = 3) -> list[np.ndarray]:
    """The sample's uint8 RGB images (:data:`IMAGE_SIZES`)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in IMAGE_SIZES]


def sample(folder: str | Path) -> torch.Tensor:
    """``[1, S]`` ids as the Omni processor lays them out: text, each image's run between the
    vision bos / eos, each clip's between the audio bos / eos, as long as HF makes them, and
    the video with its sound interleaved (``use_audio_in_video``; its tokens ``<|VIDEO|>``)."""
    from megatron_plugins.encoders.qwen2_5_omni_audio import audio_tokens, mel_frames

    grids = qwen_processor(folder)(images(), return_tensors="pt")["image_grid_thw"]
    image_runs = [[VISION_WRAPPING[0], *[IMAGE_TOKEN] * (int(g.prod()) // 4), VISION_WRAPPING[1]]
                  for g in grids]
    audio_runs = [[AUDIO_WRAPPING[0], *[AUDIO_TOKEN] * audio_tokens(mel_frames(n, 160, 480000)),
                   AUDIO_WRAPPING[1]] for n in CLIPS]
    composite = video_with_sound_ids(_video_inputs(folder)["grid_thw"][0], 1.0,
                                     audio_tokens(mel_frames(SOUND_SAMPLES, 160, 480000)))
    ids = [5, 17, *image_runs[0], 42, 8, *audio_runs[0], 23, *image_runs[1], 9, 30,
           *audio_runs[1], 12, *composite, 3, 4]
    return torch.tensor([ids])


def hf_thinker_logits(folder: str | Path, ids: torch.Tensor) -> np.ndarray:
    """transformers' thinker forward on the sample in float64 (its float32 casts inside, the
    norms', kept float64: :func:`~tests.harness.gated_delta_net.float64_throughout`), the
    processors' float32 inputs widened, at the TMRoPE positions of its ``get_rope_index``, given
    the ``vision_start_token_id`` the thinker config lacks (its forward, without it, does not
    find the images' starts): the exact reference for our float32 run. Its own float32 forward
    is 4.6e-7 of the largest logit from it."""
    import transformers

    from tests.harness.gated_delta_net import float64_throughout

    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float64)
    model.config.vision_start_token_id = VISION_WRAPPING[0]
    pixels = qwen_processor(folder)(images(), return_tensors="pt")
    audio = hf_audio_inputs([*clips(), sound()])  # the video's sound after the clips
    videos = _video_inputs(folder)
    positions, _ = model.model.get_rope_index(
        ids, pixels["image_grid_thw"], videos["grid_thw"], torch.ones_like(ids), True,
        audio["feature_attention_mask"].sum(-1), torch.tensor([1.0]))
    with torch.no_grad(), float64_throughout():
        return model(input_ids=ids, pixel_values=pixels["pixel_values"].double(),
                     image_grid_thw=pixels["image_grid_thw"],
                     pixel_values_videos=videos["pixel_values"].double(),
                     video_grid_thw=videos["grid_thw"], position_ids=positions,
                     input_features=audio["input_features"].double(),
                     feature_attention_mask=audio["feature_attention_mask"]).logits.numpy()


def media() -> dict[str, list[Any]]:
    """The sample's items per encoder ``--hf-model`` makes of the folder: its images and its
    video, then its clips and the video's sound."""
    from megatron_plugins.media.codec import Waveform

    return {"image": [*images(), video()],
            "audio": [Waveform(c, RATE) for c in (*clips(), sound())]}


def _forward(session: Any, mimo: Any, ids: torch.Tensor,
             items: dict[str, list[Any]]) -> dict[str, Any]:
    """One forward of the sample (``ids``, each encoder's ``items``) over the grids: each
    encoder on ranks of its own has its TP rank 0 send its rows (DeepStack levels beside them)
    to every language rank, an encoder colocated on the language's ranks runs there (every rank
    of its TP group computing the whole rows); the first stage takes them, the last returns the
    whole logits."""
    import torch.distributed as dist

    from megatron_plugins.data.audio_in_video import AudioInVideo
    from megatron_plugins.data.positions import item_layout, mrope_position_ids
    from megatron_plugins.media.codec import Video, media_size
    from megatron_plugins.weights.flags import checkpoint_audio_in_video
    from tests.models.hf import hand_on

    mimo.eval()
    topology, length = session.topology, ids.shape[1]
    module = "language" if "language" in topology.active_modules else topology.active_modules[0]
    pgc, grid = topology.module_pgs[module], topology.grids["language"]
    result = {"special_token_ids": dict(mimo.special_token_ids)}

    def encoder_inputs(name: str) -> dict[str, Any]:
        preprocessor = session.run.plugins[name].preprocessor()
        return {name: preprocessor.collate([preprocessor(item) for item in items[name]])}

    with torch.no_grad():
        if module != "language":
            outputs, _ = mimo(input_ids=ids, modality_inputs={module: encoder_inputs(module)})
            if pgc.tp.rank() == 0:
                for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
                    dist.send(outputs[module].contiguous(), dst=rank)
            return result
        layouts, features = {}, {}
        hidden = mimo.language_model.config.hidden_size
        for name, media_items in items.items():
            plugin = session.run.plugins[name]
            layouts[mimo.special_token_ids[name]] = [item_layout(plugin, media_size(i))
                                                     for i in media_items]
            if name in topology.hosted:
                features[name] = mimo.modality_submodules[name](
                    encoder_inputs=encoder_inputs(name), hidden_states=None)
                continue
            rows = sum(plugin.item_tokens(media_size(i)) for i in media_items)
            features[name] = torch.empty(rows, (1 + plugin.deepstack_levels) * hidden)
            dist.recv(features[name], src=topology.grids[name].rank_offset)
        image, audio = (mimo.special_token_ids[name] for name in ("image", "audio"))
        if isinstance(items["image"][-1], Video):  # the last item; its sound the last clip
            *clip_layouts, (sound_tokens, _) = layouts[audio]
            sounds = AudioInVideo(*checkpoint_audio_in_video(session.run.args))
            layouts[image].append(sounds.with_sound(layouts[image].pop(), audio, sound_tokens))
            layouts[audio] = clip_layouts
        ours = torch.where(ids[0] == VIDEO_TOKEN, image, ids[0])  # the tower's one placeholder
        after_time = {image} if session.run.plugins["image"].text_after_time else ()
        positions = mrope_position_ids(ours, layouts, after_time).unsqueeze(1)
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)[None, None]
        stage, ranks = pgc.pp.rank(), dist.get_process_group_ranks(pgc.pp)
        if stage == 0:
            mimo.set_input_tensor(features)
        else:
            received = torch.empty(length, 1, mimo.language_model.config.hidden_size)
            dist.recv(received, src=ranks[stage - 1], group=pgc.pp)
            mimo.set_input_tensor({"language": received})
        output, _ = mimo(input_ids=ours[None], position_ids=positions, attention_mask=mask)
        if isinstance(output, dict):
            output = output["language"]
        return {**result, "logits": hand_on(output, pgc)}


def _forward_and_stream(session: Any, mimo: Any, ids: torch.Tensor,
                        items: dict[str, list[Any]]) -> dict[str, Any]:
    from tests.models.hf_vlm import whole_pieces

    return {**_forward(session, mimo, ids, items), "pieces": whole_pieces(mimo, session)}


def omni_flags(folder: str | Path, grids: tuple[str, ...]) -> list[str]:
    """A MiMo launch from the whole folder; no encoder, shape or weights flags."""
    from tests.models.hf import MIMO_FLAGS

    return [*MIMO_FLAGS, "--seq-length", "1600", "--hf-model", str(folder),
            *(part for grid in grids for part in ("--grid", grid))]


def forward_rank(argv: list[str], ids: torch.Tensor,
                 items: dict[str, list[Any]]) -> dict[str, Any]:
    """One rank of the MiMo model built from ``--hf-model``: logits, streamed pieces."""
    import functools

    from tests.models.hf import built_then

    return built_then(argv, functools.partial(_forward_and_stream, ids=ids, items=items))


def forward(nproc: int, folder: str | Path, grids: tuple[str, ...], ids: torch.Tensor,
            items: dict[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    """:func:`forward_rank` on ``nproc`` gloo ranks (``items``: each encoder's, by default
    :func:`media`); pieces deserialized."""
    from tests.harness.multiprocess import run_in_processes
    from tests.models.hf import pieces_from

    results = run_in_processes(forward_rank, nproc,
                               args=(omni_flags(folder, grids), ids, items or media()),
                               timeout=300, simulated=True)
    for result in results:
        result["pieces"] = pieces_from(result["pieces"])
    return results


def forward_diff(nproc: int, folder: str | Path, grids: tuple[str, ...], ids: torch.Tensor,
                 want: np.ndarray, items: dict[str, list[Any]], tokens: dict[str, int],
                 carried: str) -> float:
    """Our logits' max relative difference from transformers' ``want`` over the grids, after
    checking what every layout must give: each TP rank of the last stage the same logits, the
    checkpoint's own ``tokens`` marking each encoder's items, and every tensor of the folder
    but the ``carried`` ones (a regex) streamed back unchanged."""
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import rel_diff, safetensors_of

    results = forward(nproc, folder, grids, ids, items)
    logits, *others = [r["logits"] for r in results if r.get("logits") is not None]
    for other in others:
        np.testing.assert_array_equal(other, logits)
    for result in results:
        assert result["special_token_ids"] == tokens
    streamed = assemble(piece for result in results for piece in result["pieces"])
    original = safetensors_of(folder)
    assert sorted(streamed) == sorted(n for n in original if not re.match(carried, n))
    for name, tensor in streamed.items():
        assert torch.equal(tensor, original[name]), name
    return rel_diff(logits[..., :VOCAB], want)


def train_reference(folder: Path, root: Path, grids: tuple[str, ...], nproc: int,
                    extra: tuple[str, ...]) -> tuple[Path, Path, list[list[Any]],
                                                     tuple[dict[int, float],
                                                           dict[str, torch.Tensor]]]:
    """Three SGD steps of ``folder`` on the mock data at ``grids``, saved under ``root/first``:
    ``root``, ``folder``, every rank's streamed pieces, and the per-iteration ``lm loss`` and
    trained tensors (:func:`tests.models.hf_vlm.assert_trains_like`'s reference)."""
    from megatron_plugins.weights.streaming import assemble
    from tests.harness.tensorboard_scalars import read_scalars
    from tests.models.hf_vlm import SGD_TRAIN, vlm_train

    pieces = vlm_train(nproc, folder, grids, (
        *SGD_TRAIN, *extra, "--tensorboard-dir", str(root / "reference"),
        "--save", str(root / "first"), "--save-interval", "3"))
    return root, folder, pieces, (read_scalars(root / "reference", "lm loss"),
                                  assemble(p for rank in pieces for p in rank))


def assert_lora_trains_like(folder: Path, root: Path, reference: tuple[tuple[str, ...], int],
                            other: tuple[tuple[str, ...], int], extra: tuple[str, ...],
                            *moving: str) -> set[str]:
    """Short SGD runs of ``folder`` with ``extra`` (its ``--lora`` flags) at ``reference`` and
    ``other`` ((grids, ranks) each) train identically, and the trained tensors that differ from
    the folder's are exactly those whose names match one of ``moving`` (regexes, from the
    name's start); returns them. The ``other`` run's checkpoint (adapters saved sharded as that
    layout holds them) exports the tensors it streamed, adapters merged, bit for bit."""
    from tests.models.hf import safetensors_of
    from tests.models.hf_vlm import assert_trains_like, export, sgd_run

    first = sgd_run(folder, root, "reference", reference[1], reference[0], extra)
    second = sgd_run(folder, root, "other", other[1], other[0],
                     (*extra, "--save", str(root / "saved"), "--save-interval", "3"))
    assert_trains_like(first, second, f"lora {' '.join(other[0])}")
    export(root, ("saved",))
    exported = safetensors_of(root / "out_saved")
    assert {name for name, tensor in second[1].items()
            if not torch.equal(exported[name], tensor)} == set()
    original = safetensors_of(folder)
    moved = {name for name, tensor in first[1].items() if not torch.equal(tensor, original[name])}
    expected = {name for name in first[1] if any(re.match(p, name) for p in moving)}
    assert moved == expected, (sorted(moved - expected), sorted(expected - moved))
    return moved


def peft_folder_difference(base: Path, export: Path, model_class: str) -> float:
    """The export's PEFT-format folder (``export/adapters``) put on transformers'
    ``model_class`` of ``base`` by ``peft`` and merged, against the merged export: the largest
    difference over every tensor, relative to the tensor's largest magnitude."""
    import peft
    import transformers

    load = getattr(transformers, model_class).from_pretrained
    adapted = peft.PeftModel.from_pretrained(load(base), export / "adapters").merge_and_unload()
    ours, theirs = adapted.state_dict(), load(export).state_dict()
    assert ours.keys() == theirs.keys()
    return max(float((ours[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
               for k, v in theirs.items())


def export_two_layouts(folder: Path, root: Path, pieces: list[list[Any]],
                       resaved: tuple[tuple[str, ...], int], extra: tuple[str, ...],
                       untrained: tuple[str, ...], moved: tuple[str, ...],
                       loaded_as: tuple[tuple[str, str], ...]
                       ) -> tuple[list[str], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`train_reference`'s checkpoint and the same weights re-saved at ``resaved``
    (grids, ranks) exported to one folder, file for file the same bytes, holding the trained
    tensors as the run streamed them (``pieces``) and the ``untrained`` ones (name prefixes)
    unchanged, the ``moved`` ones trained; transformers loads it as the folder's class, its
    in-memory tensors the written ones (``loaded_as``: (in-memory name, file name) pairs).
    Returns the folder's files, its tensors and transformers' state dict."""
    import transformers

    from megatron_plugins.weights.vlm_families import read_vlm
    from tests.models.hf import safetensors_of
    from tests.models.hf_vlm import check_export, export, identical_exports, resave

    resave(folder, root, "second", resaved[1], resaved[0], extra)
    export(root, ("first", "second"))
    out = root / "out_first"
    files = identical_exports(root)
    written, original = check_export(out, folder, pieces, untrained), safetensors_of(folder)
    for name in moved:
        assert not torch.equal(written[name], original[name]), name
    architecture = read_vlm(str(out))[1]["architectures"][0]
    loaded = getattr(transformers, architecture).from_pretrained(
        out, dtype=torch.float32).state_dict()
    for name, file_name in loaded_as:
        assert torch.equal(loaded[name], written[file_name]), name
    return files, written, loaded


def first_batch_loss(folder: str | Path, samples: int, seq_length: int,
                     items_per_sample: tuple[int, int], seed: int,
                     logits: Callable[[torch.Tensor, dict[str, list[Any]]], torch.Tensor]
                     ) -> float:
    """transformers' loss on the first ``samples`` mock samples of a run from the Omni folder
    (the first global batch): the mock rebuilt here gives the run's tokens, labels, loss mask,
    each tower's items (images, clips of drawn lengths) marked by the folder's own ids;
    ``logits(ids, items)`` is the thinker's ``[S, vocab]`` on one sample; the loss is the masked
    token loss summed over the batch over its token count, as the run reports it."""
    from types import SimpleNamespace

    from megatron_plugins.data.mock import MockSource
    from megatron_plugins.weights.flags import checkpoint_item_wrapping
    from megatron_plugins.weights.vlm_families import read_vlm
    from tests.models.hf_vision import plugin

    vlm, config = read_vlm(str(folder))
    towers = {tower.encoder_name: tower for tower in vlm.towers}
    plugins = {name: plugin(tower.encoder_provider, folder) for name, tower in towers.items()}
    source = MockSource(seed=seed, seq_length=seq_length, vocab_size=VOCAB, plugins=plugins,
                        items_per_sample=items_per_sample, mrope=True,
                        placeholder_ids={name: tower.token_id(config)
                                         for name, tower in towers.items()},
                        wrapping=checkpoint_item_wrapping(SimpleNamespace(
                            hf_model=str(folder),
                            encoder_hf_weights=[f"{name}={folder}" for name in plugins])))
    total, tokens = 0.0, 0.0
    for index in range(samples):
        text = source.text("train", index)
        items = {name: source.media(name, "train", index) for name in plugins}
        with torch.no_grad():
            out = logits(text["tokens"].unsqueeze(0), items)
        losses = torch.nn.functional.cross_entropy(out.double(), text["labels"],
                                                   reduction="none")
        total += float((losses * text["loss_mask"]).sum())
        tokens += float(text["loss_mask"].sum())
    return total / tokens


def hf_first_batch_loss(folder: str | Path, samples: int, seq_length: int,
                        items_per_sample: tuple[int, int], seed: int) -> float:
    """:func:`first_batch_loss` of transformers' Qwen2.5-Omni thinker, its positions from its
    ``get_rope_index``."""
    import transformers

    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    model.config.vision_start_token_id = VISION_WRAPPING[0]
    processor = qwen_processor(folder)

    def logits(ids: torch.Tensor, items: dict[str, list[Any]]) -> torch.Tensor:
        pixels = processor(items["image"], return_tensors="pt")
        audio = hf_audio_inputs([clip.samples for clip in items["audio"]])
        positions, _ = model.model.get_rope_index(
            ids, pixels["image_grid_thw"], None, torch.ones_like(ids), False,
            audio["feature_attention_mask"].sum(-1), None)
        return model(input_ids=ids, pixel_values=pixels["pixel_values"],
                     image_grid_thw=pixels["image_grid_thw"], position_ids=positions,
                     **audio).logits[0]

    return first_batch_loss(folder, samples, seq_length, items_per_sample, seed, logits)


OMNI_SPECIAL_TOKENS = ("<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>",
                       "<|vision_bos|>", "<|vision_eos|>")
"""The released tokenizer's special tokens, in the order of the tiny folder's ids (50 to 56)."""


def save_omni_tokenizer(folder: str | Path, texts: list[str]) -> Path:
    """The folder's own tokenizer, as a released folder ships one: text tokens trained on
    ``texts`` below the checkpoint's ids (unused ones filling up to them), then the Omni special
    tokens at the ids the checkpoint marks items with."""
    import tempfile

    import transformers

    from tools.train_tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        trained = train_tokenizer([*texts, "system : user : assistant :"], AUDIO_TOKEN,
                                  Path(scratch) / "tokenizer")
        tokenizer = transformers.AutoTokenizer.from_pretrained(trained)
    tokenizer.add_tokens([f"<unused_{i}>" for i in range(AUDIO_TOKEN - len(tokenizer))])
    tokenizer.add_special_tokens({"additional_special_tokens": list(OMNI_SPECIAL_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(OMNI_SPECIAL_TOKENS))
    assert ids == list(range(AUDIO_TOKEN, AUDIO_TOKEN + len(OMNI_SPECIAL_TOKENS))), ids
    tokenizer.save_pretrained(folder)
    return Path(folder)
