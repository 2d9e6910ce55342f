"""``--hf-model DIR`` with a whole Qwen3-Omni-MoE folder: its vision tower (Qwen3-VL-MoE's, with
DeepStack into the first language layers), its audio tower (AuT) and its Qwen3-MoE language model
with interleaved multimodal RoPE, each a module on its own grid or the vision tower colocated on
the language's, give transformers' float64 thinker logits on one sample of two images, two clips
and a video with its sound merged by time (``use_audio_in_video``; at a 29.97-fps file's
sampled rate, so positions are fractional) at three layouts (experts
split over EP 2 in one); every tensor of the modules streams back unchanged, the talker and
code2wav are carried (one notice at start); our videos' tokens and positions, with their sound or
without, are transformers' processor's and ``get_rope_index``'s. One training run serves the
rest: its first loss is transformers', the vision tower colocated with EP 2 trains as it does,
and its checkpoint and the same weights saved at another layout export one folder, byte for
byte, which transformers loads; LoRA on both towers and the language model, packed rows and
language CP 2 (without the load-balancing loss) train identically too. A thinker-only save
splits into the same parts; a config Megatron would compute differently is one line."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from tests.models.qwen3_omni_whole import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    hf_thinker_logits,
    media,
    sample,
    save_tiny_qwen3_omni,
)
from tests.models.qwen_omni import export_two_layouts, forward_diff, train_reference

TOLERANCE = 1e-5
"""Our float32 logits against transformers' float64 ones, relative to their largest magnitude."""
CARRIED = r"talker\.|code2wav\."
"""The tensors of no module here: the talker and code2wav."""
SPLIT = (("image:tp=2@language", "audio:tp=2", "language:dp=2,ep=2"), 4)
"""The vision tower at TP 2 colocated on the language's DP 2 ranks, which split the experts
(EP 2), the audio tower at TP 2 on ranks of its own."""


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """The tiny folder, the sample and transformers' thinker logits on it."""
    folder = save_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni") / "omni")
    ids = sample(folder)
    assert int((ids == AUDIO_TOKEN).sum()) == 34 + 10 + 39  # 258, 73 and 300 mel frames
    return folder, ids, hf_thinker_logits(folder, ids)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", [
    pytest.param(("image:dp=1", "audio:dp=1", "language:dp=1"), 3, id="one-rank-per-module"),
    pytest.param(("image:tp=2", "audio:tp=2", "language:pp=2"), 6,
                 id="vision-tp2-audio-tp2-language-pp2"),
    pytest.param(*SPLIT, id="vision-tp2-colocated-audio-tp2-own-language-dp2-ep2")])
@pytest.mark.multirank
def test_whole_qwen3_omni_reproduces_transformers_thinker_logits_and_streams_back(
        omni, grids, nproc):
    """The last layout has the vision tower on the language's ranks (both replicas take the
    sample; the experts split over them), the audio tower on ranks of its own."""
    folder, ids, want = omni
    tokens = {"image": IMAGE_TOKEN, "audio": AUDIO_TOKEN}
    diff = forward_diff(nproc, folder, grids, ids, want, media(), tokens, CARRIED)
    print(f"{grids}: logits max relative difference {diff:.1e}")
    assert diff < TOLERANCE


ONE_RANK_EACH = (("image:dp=1", "audio:dp=1", "language:dp=1"), 3)
OMNI_TRAIN = ("--seq-length", "128")
"""Rows longer than the longest mock sample (two images and two clips of up to 1.3 s)."""
UNTRAINED = ("talker.", "code2wav.")
"""Tensors of no module here, carried unchanged."""


@pytest.fixture(scope="module")
def trained(omni, tmp_path_factory):
    """One run shared by the loss, invariance and export tests: three SGD steps at one rank per
    module on the mock data (images, clips of 0.1 to 1.3 s), saved."""
    folder, _, _ = omni
    root = tmp_path_factory.mktemp("qwen3_omni_training")
    return train_reference(folder, root, *ONE_RANK_EACH, OMNI_TRAIN)


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_the_vision_tower_colocated_and_experts_split_train_identically(trained):
    """The vision tower at TP 2 colocated on the language's DP 2 ranks (its rows and DeepStack
    levels routed to the replica that merges them), the language's experts split over those
    ranks (EP 2) and the audio tower at TP 2 on ranks of its own train as one rank per module
    does, losses and every trained tensor."""
    from tests.models.hf_vlm import assert_trains_like, sgd_run

    root, folder, _, reference = trained
    assert_trains_like(reference, sgd_run(folder, root, "split", SPLIT[1], SPLIT[0], OMNI_TRAIN),
                       "vision-colocated-audio-tp2-language-ep2")


LORA = ("--lora", "image:rank=4,alpha=8", "--lora", "audio:rank=4,alpha=8",
        "--lora", "language:rank=4,alpha=8")
"""LoRA on every linear of both towers' layers and of the language model: its attention and every
routed expert's MLP; the towers' projections train fully."""


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_lora_on_both_towers_and_the_language_model_trains_identically(omni, tmp_path):
    """LoRA on the vision tower, the audio tower and the language model (its experts too) trains
    the same with the vision tower at TP 2 colocated on the language's DP 2 ranks, the experts
    split over EP 2 (each DP rank holding different experts' adapters), and the audio tower at
    TP 2 on ranks of its own; only the adapted linears (merged) and the projections move: not
    the router, norms, biases, embeddings or convolutions. The export writes no PEFT-format
    folder: transformers fuses each layer's experts into one tensor, no linear to adapt."""
    from tests.models.qwen_omni import assert_lora_trains_like

    moved = assert_lora_trains_like(
        omni[0], tmp_path, ONE_RANK_EACH, SPLIT, (*OMNI_TRAIN, *LORA),
        r"thinker\.(audio_tower\.layers\.\d\.(fc\d|self_attn\.\w+_proj)|"
        r"visual\.blocks\.\d\.(attn\.(qkv|proj)|mlp\.linear_fc\d)|"
        r"model\.layers\.\d\.(self_attn\.\w_proj|mlp\.experts\.\d\.(gate|up|down)_proj))\.weight$",
        r"thinker\.(audio_tower\.(ln_post|proj\d)|visual\.merger(_list)?)\.")
    assert {n.split(".")[1] for n in moved} == {"audio_tower", "visual", "model"}
    assert (tmp_path / "out_saved").is_dir() and not (tmp_path / "out_saved" / "adapters").exists()


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_packed_rows_and_language_cp2_train_identically_without_the_load_balancing_loss(
        omni, tmp_path):
    """Packed rows and language CP 2 (positions and DeepStack levels split by CP) train as one
    rank per module does, on samples whose vision items are, one time in two, 4-frame videos
    at 3 frames a second (8.67 temporal positions a step, so every position after one is
    fractional; a packed row's positions per sample; rows that hold two such samples whole, as
    a cut sample would train differently). The folder's
    router_aux_loss_coef is set to 0: the load-balancing loss counts the tokens each microbatch
    routes, and unpacked rows route their padding too (with 0.001, step 3 of a packed run
    differs by 1.6e-5)."""
    import json

    from tests.models.hf_vlm import assert_trains_like, edited, sgd_run

    folder = omni[0]
    thinker = json.loads((folder / "config.json").read_text())["thinker_config"]
    balanced = edited(folder, tmp_path / "no_aux_loss", config={"thinker_config": {
        **thinker, "text_config": {**thinker["text_config"], "router_aux_loss_coef": 0.0}}})
    videos = ("--seq-length", "256", "--mock-video-frames", "4",  # two samples, never cut
              "--mock-video-fps", "3")
    reference = sgd_run(balanced, tmp_path, "reference", ONE_RANK_EACH[1], ONE_RANK_EACH[0],
                        videos)
    for name, nproc, grids, *flags in (
            ("packed", 3, ONE_RANK_EACH[0], "--pack-sequences"),
            ("language-cp2", 4, ("image:dp=1", "audio:dp=1", "language:cp=2"))):
        run = sgd_run(balanced, tmp_path, name, nproc, grids, (*videos, *flags))
        assert_trains_like(reference, run, name)


@pytest.mark.timeout(400)
@pytest.mark.multirank
def test_training_starts_from_transformers_loss_on_the_first_batch(trained):
    """Step 1 (the folder's weights) is transformers' thinker loss on the same first global
    batch: its images, its clips of drawn lengths, its own multimodal RoPE positions, its
    DeepStack and its experts."""
    from tests.models.qwen3_omni_whole import hf_first_batch_loss

    _, folder, _, (losses, _) = trained
    assert losses[1] == pytest.approx(hf_first_batch_loss(folder, 4, 128, (1, 2), 1234),
                                      rel=1e-5)


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_two_saving_layouts_export_one_identical_omni_folder_transformers_loads(trained):
    """The trained checkpoint (one rank per module) and the same weights re-saved with both
    towers at TP 2 and the language at PP 2 export one folder, byte for byte: the trained
    thinker as the run streamed it (experts one tensor each, as the folder saves them), the
    talker and code2wav unchanged, loaded by transformers as the same class (experts fused)."""
    root, folder, pieces, _ = trained
    files, written, loaded = export_two_layouts(
        folder, root, pieces, (("image:tp=2", "audio:tp=2", "language:pp=2"), 6), OMNI_TRAIN,
        UNTRAINED, ("thinker.audio_tower.layers.0.self_attn.q_proj.bias",
                    "thinker.audio_tower.proj2.weight", "thinker.audio_tower.conv2d1.weight",
                    "thinker.visual.blocks.0.attn.qkv.weight",
                    "thinker.visual.merger.mlp.0.weight",
                    "thinker.visual.merger_list.1.ln_q.weight",
                    "thinker.model.layers.1.mlp.experts.3.up_proj.weight",
                    "thinker.model.layers.0.mlp.gate.weight", "thinker.lm_head.weight"),
        (("thinker.model.audio_tower.layers.1.fc2.weight",
          "thinker.audio_tower.layers.1.fc2.weight"),
         ("thinker.model.visual.merger_list.0.mlp.2.bias",
          "thinker.visual.merger_list.0.mlp.2.bias"),
         ("thinker.model.language_model.embed_tokens.weight",
          "thinker.model.embed_tokens.weight"),
         ("thinker.lm_head.weight", "thinker.lm_head.weight"),
         ("talker.model.layers.0.mlp.shared_expert.up_proj.weight",
          "talker.model.layers.0.mlp.shared_expert.up_proj.weight")))
    assert files == sorted(path.name for path in folder.iterdir())  # every file beside them
    experts = "thinker.model.layers.2.mlp.experts"
    assert torch.equal(loaded["thinker.model.language_model.layers.2.mlp.experts.gate_up_proj"],
                       torch.stack([torch.cat([written[f"{experts}.{e}.gate_proj.weight"],
                                               written[f"{experts}.{e}.up_proj.weight"]])
                                    for e in range(4)]))


@pytest.mark.parametrize("thinker_only", [False, True], ids=["whole", "thinker-only"])
def test_the_folder_splits_into_five_parts_and_carried_tensors(omni, tmp_path, thinker_only):
    """Every tensor of a whole folder, or of a thinker-only save (no ``thinker.`` prefix), is
    mapped by exactly one of the towers, their projections and the language model and left out
    by the others, or carried (talker, code2wav) and left out by all; each part's names are the
    folder's."""
    from megatron_plugins.weights.audio_families import QWEN3_OMNI_AUDIO
    from megatron_plugins.weights.hf_folder import HFCheckpoint
    from megatron_plugins.weights.vision_families import QWEN3_OMNI_VISION
    from megatron_plugins.weights.vlm_families import QWEN3_OMNI_MOE, part_families, read_vlm

    folder = (save_tiny_qwen3_omni(tmp_path / "thinker", thinker_only=True) if thinker_only
              else omni[0])
    vlm, config = read_vlm(str(folder))
    assert vlm is QWEN3_OMNI_MOE
    names = HFCheckpoint(folder, "--hf-model").names()
    audio = part_families(vlm, config, QWEN3_OMNI_AUDIO, names)
    vision = part_families(vlm, config, QWEN3_OMNI_VISION, names)
    parts = (audio.tower, audio.projector, vision.tower, vision.projector, vision.language)
    prefix = "" if thinker_only else "thinker."
    assert vision.projector.bind("0.deepstack.1.mlp.encoder.linear_fc2.weight").hf == (
        f"{prefix}visual.merger_list.1.mlp.2.weight",)
    assert vision.language.bind("decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"
                                ).hf == (f"{prefix}model.layers.3.mlp.experts.2.gate_proj.weight",
                                         f"{prefix}model.layers.3.mlp.experts.2.up_proj.weight")
    assert audio.projector.bind("0.proj2.bias").hf == (f"{prefix}audio_tower.proj2.bias",)
    assert any(re.match(CARRIED, name) for name in names) is not thinker_only
    maps = {part.name: {hf.format(layer=layer, expert=expert) for rule in part.rules
                        for hf in rule.hf for layer in range(4) for expert in range(4)}
            for part in parts}
    for name in names:
        owners = [part.name for part in parts if name in maps[part.name]]
        assert len(owners) == (0 if re.match(CARRIED, name) else 1), (name, owners)
        # every other part leaves it out on purpose, so a load of that part accounts for it
        assert all(part.is_unused(name) for part in parts if part.name not in owners), name


def test_a_config_megatron_would_compute_differently_is_one_line(omni, tmp_path, monkeypatch):
    """A thinker whose language model mixes dense MLP layers among its MoE layers is refused in
    one line naming config.json's field."""
    import json

    from tests.models.hf_vlm import bad_input, edited, vlm_flags

    folder = omni[0]
    thinker = json.loads((folder / "config.json").read_text())["thinker_config"]
    dense = edited(folder, tmp_path / "dense", config={"thinker_config": {
        **thinker, "text_config": {**thinker["text_config"], "mlp_only_layers": [1]}}})
    grids = ("image:dp=1", "audio:dp=1", "language:dp=1")
    assert bad_input(vlm_flags(dense, grids), monkeypatch, world_size=3) == (
        "config.json mlp_only_layers = [1] is not supported (every layer must be an MoE layer); "
        "only [] can be imported")


def test_one_notice_at_start_names_the_carried_talker_and_code2wav(omni, capsys):
    """Before any process group, the launch's check of the folder says once (rank 0) which
    tensors no module trains."""
    from types import SimpleNamespace

    from megatron_plugins.weights.flags import check_hf_model, expand_hf_model
    from tests.models.hf_vision import plugin

    folder = omni[0]
    args = SimpleNamespace(hf_model=str(folder), language_hf_weights=None, mimo_encoders=None,
                           encoder_hf_weights=None)
    expand_hf_model(args)
    assert args.mimo_encoders == {"image": "qwen3_omni_vision", "audio": "qwen3_omni_audio"}
    check_hf_model(args, {name: plugin(provider, folder)
                          for name, provider in args.mimo_encoders.items()})
    notice = capsys.readouterr().err
    assert notice.count("\n") == 1 and "notice:" in notice, notice
    assert f"{folder}: 102 tensors of no module here" in notice
    assert "(code2wav.*, the talker and code2wav)" in notice


VIDEOS = [("text", 3), ("video", (4, 16, 16, 2.0)), ("text", 2), ("audio", 13000),
          ("image", (24, 40)), ("video", (3, 21, 30, 1.0)), ("text", 1),
          ("video", (12, 8, 8, 2.0)), ("audio", 1600), ("text", 2), ("video", (6, 16, 16, 3.0)),
          ("video", (8, 8, 8, 1.998)), ("text", 2), ("image", (16, 16)), ("text", 1)]
"""Text, videos at 2 and 1 frames a second (13 and 26 positions a step, past their rows and
columns), at 3 and 1.998 (a 29.97-fps file sampled at 2 a second: 8.67 and 13.01 positions a
step, every position after them fractional), clips and images, each run between its start / end
ids."""
WITH_SOUND = [("text", 2), ("image", (16, 16)), ("audio", 13000),
              ("video", (4, 16, 16, 2.0), 32000), ("text", 1),
              ("video", (12, 8, 8, 2.0), 20800), ("text", 2),
              ("video", (6, 8, 8, 1.998), 48000), ("audio", 5000),
              ("video", (4, 16, 16, 3.0), 4000), ("text", 2)]
"""``use_audio_in_video``: a video whose 2-s sound outlasts its frames' time, one whose
1.3-s sound ends before its last frames' time, then at fractional positions a step (1.998 and
3 frames a second) among a clip, an image and text."""


@pytest.mark.parametrize("items", [VIDEOS, WITH_SOUND], ids=["videos", "videos-with-sound"])
def test_video_layout_and_positions_equal_the_processor_s_and_get_rope_index(omni, items):
    """Qwen3-Omni's videos (no timestamp text: Qwen2-VL's video processor) at the folder's 13
    positions a second, float32 and not truncated, the text after past their last time step;
    with their sound (``use_audio_in_video``) merged token by token by time, a video token
    first on a tie, each start / end id at a position of its own: our tokens equal transformers'
    processor's (``replace_video_with_audio_token``) and our positions its thinker's
    ``get_rope_index``, bit for bit, fractional ones too."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    from megatron_plugins.data.audio_in_video import AudioInVideo
    from megatron_plugins.data.positions import item_layout, mrope_position_ids
    from megatron_plugins.data.sources import audio_in_video
    from megatron_plugins.encoders.qwen2_5_omni_audio import mel_frames
    from tests.models.hf_vision import plugin
    from tests.models.qwen3_omni import AUDIO
    from tests.models.qwen3_omni_whole import (
        AUDIO_WRAPPING,
        POSITIONS_PER_SECOND,
        VIDEO_TOKEN,
        VISION_WRAPPING,
        hf_thinker,
    )
    from tests.models.qwen_omni import video_with_sound_ids

    folder = omni[0]
    vision, audio = plugin("qwen3_omni_vision", folder), plugin("qwen3_omni_audio", folder)
    sounds = audio_in_video(argparse.Namespace(  # the flag with this folder: merged by time
        use_audio_in_video=True, data_path=["d"], hf_model=str(folder),
        encoder_hf_weights={"image": str(folder), "audio": str(folder)},
        mimo_encoders={"image": "qwen3_omni_vision", "audio": "qwen3_omni_audio"}))
    assert sounds == AudioInVideo("image", "audio", None)
    ours, theirs, layouts = [], [], {IMAGE_TOKEN: [], AUDIO_TOKEN: []}
    images, videos, seconds, frames = [], [], [], []
    for kind, value, *sound in items:
        if kind == "text":
            ours += list(range(5, 5 + value))
            theirs += list(range(5, 5 + value))
            continue
        encoder, token = (audio, AUDIO_TOKEN) if kind == "audio" else (vision, IMAGE_TOKEN)
        for samples in [value] if kind == "audio" else sound:
            frames.append(mel_frames(samples, 160, 10 ** 9))
            assert audio.item_tokens((samples, 16000)) == int(_get_feat_extract_output_lengths(
                torch.tensor(frames[-1]), AUDIO["n_window"]))
        layout = item_layout(encoder, (value, 16000) if kind == "audio" else value)
        start, end = AUDIO_WRAPPING if kind == "audio" else VISION_WRAPPING
        if kind != "audio":
            grid = layout[1]
            (videos if kind == "video" else images).append(
                torch.tensor([grid[0], grid[1] * 2, grid[2] * 2]))
            if kind == "video":
                seconds.append(2 / value[3])
                assert grid[3][1] == pytest.approx(2 / value[3] * POSITIONS_PER_SECOND)
        if sound:
            sound_tokens = audio.item_tokens((sound[0], 16000))
            layout = sounds.with_sound(layout, AUDIO_TOKEN, sound_tokens)
            run = [start, AUDIO_WRAPPING[0],
                   *(token for is_video, size in layout.order
                     for token in [IMAGE_TOKEN if is_video else AUDIO_TOKEN] * size),
                   AUDIO_WRAPPING[1], end]
            processor = video_with_sound_ids(videos[-1], seconds[-1], sound_tokens,
                                             "Qwen3OmniMoeProcessor", POSITIONS_PER_SECOND)
            assert run == [IMAGE_TOKEN if t == VIDEO_TOKEN else t for t in processor]
            ours, theirs = ours + run, theirs + processor
        else:
            hf_token = VIDEO_TOKEN if kind == "video" else token  # the tower's one placeholder
            ours += [start, *[token] * layout[0], end]
            theirs += [start, *[hf_token] * layout[0], end]
        layouts[token].append(layout)
    got = mrope_position_ids(torch.tensor(ours), layouts,
                             {IMAGE_TOKEN} if vision.text_after_time else ())
    hf_ids = torch.tensor([theirs])
    want, _ = hf_thinker(folder).model.get_rope_index(
        hf_ids, torch.stack(images), torch.stack(videos), torch.ones_like(hf_ids),
        any(len(item) == 3 for item in items), torch.tensor(frames), torch.tensor(seconds))
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want[:, 0]) and not torch.equal(got, got.round())
