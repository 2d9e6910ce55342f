"""``--hf-model DIR`` with a whole Qwen2.5-Omni folder: its audio tower (2-chunk windows, per-chunk
positions, pooled), its vision tower and its TMRoPE language model, each a module on its own
grid or the audio tower colocated on the language's, give transformers' float64 thinker logits
on one sample of two images, two clips of different lengths and a video with its sound
interleaved (``use_audio_in_video``); every tensor of the
three modules streams back unchanged, the talker and token2wav are carried (no module's). The
folder trains identically across layouts, from transformers' loss, and exports back."""

from __future__ import annotations

import re

import pytest
import torch

from tests.models.qwen_omni import (
    AUDIO_TOKEN,
    AUDIO_WRAPPING,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_WRAPPING,
    export_two_layouts,
    forward_diff,
    hf_thinker_logits,
    media,
    sample,
    save_tiny_omni,
    train_reference,
)

TOLERANCE = 1e-5
"""Our float32 logits against transformers' float64 ones, relative to their largest magnitude."""

LAYOUTS = {
    "one-rank-per-module": (("image:dp=1", "audio:dp=1", "language:dp=1"), 3),
    "audio-tp2-language-pp2": (("image:dp=1", "audio:tp=2", "language:pp=2"), 5),
    "vision-tp2-own-audio-tp2-colocated": (("image:tp=2", "audio:tp=2@language",
                                            "language:dp=2"), 4),
}
"""(``--grid`` values, ranks) by test id: the last has the vision tower on ranks of its own, the
audio tower on the language's (both replicas take the sample)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny whole Qwen2.5-Omni folder."""
    return save_tiny_omni(tmp_path_factory.mktemp("qwen_omni") / "omni")


@pytest.fixture(scope="module")
def omni(folder):
    """The folder, the sample and transformers' thinker logits on it (only the tests comparing
    logits pay for them)."""
    ids = sample(folder)
    return folder, ids, hf_thinker_logits(folder, ids)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("grids, nproc", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.multirank
def test_whole_qwen2_5_omni_reproduces_transformers_logits_on_images_clips_and_a_video_s_sound(
        omni, grids, nproc):
    folder, ids, want = omni
    assert int((ids == AUDIO_TOKEN).sum()) == 20 + 33 + 75  # 82, 132 and 300 mel frames
    assert int((ids == VIDEO_TOKEN).sum()) == 3 * 16  # 3 steps of 4 x 4 merged tokens
    diff = forward_diff(nproc, folder, grids, ids, want, media(),
                        {"image": IMAGE_TOKEN, "audio": AUDIO_TOKEN},
                        r"talker\.|token2wav\.|thinker\.audio_tower\.audio_bos_eos_token\.")
    print(f"{grids}: logits max relative difference {diff:.1e}")
    assert diff < TOLERANCE


def test_the_folder_splits_into_five_parts_and_carried_tensors(folder):
    """Every tensor belongs to exactly one of the towers, their projections and the language
    model, or is carried (talker, token2wav, the audio bos / eos embedding)."""
    from megatron_plugins.weights.audio_families import QWEN2_5_OMNI_AUDIO
    from megatron_plugins.weights.hf_folder import HFCheckpoint
    from megatron_plugins.weights.vision_families import QWEN2_5_OMNI_VISION
    from megatron_plugins.weights.vlm_families import part_families, read_vlm

    vlm, config = read_vlm(str(folder))
    names = HFCheckpoint(folder, "--hf-model").names()
    audio = part_families(vlm, config, QWEN2_5_OMNI_AUDIO, names)
    vision = part_families(vlm, config, QWEN2_5_OMNI_VISION, names)
    parts = (audio.tower, audio.projector, vision.tower, vision.projector, vision.language)

    def mapped(family):
        return {n.format(layer=layer) for rule in family.rules for n in rule.hf
                for layer in range(3)} & names

    owners = {name: [p.name for p in parts if name in mapped(p)] for name in names}
    carried = {name for name in names
               if any(re.match(pattern, name) for p in parts for pattern in p.untrained)}
    assert all(len(found) == 1 for name, found in owners.items() if name not in carried), owners
    assert {n.split(".")[0] for n in carried} == {"talker", "token2wav", "thinker"}
    assert [n for n in carried if n.startswith("thinker.")] == [
        "thinker.audio_tower.audio_bos_eos_token.weight"]


ONE_RANK_EACH = (("image:dp=1", "audio:dp=1", "language:dp=1"), 3)
OMNI_TRAIN = ("--seq-length", "256")
"""Rows of twice the longest mock sample (two images and two clips of up to 1.3 s), so packed
rows of two samples cut no text and train as unpacked ones do."""
UNTRAINED = ("talker.", "token2wav.", "thinker.audio_tower.audio_bos_eos_token.")
"""Tensors of no module here: the talker, token2wav and the audio bos / eos embedding the
thinker's forward never reads; carried unchanged."""
LORA = ("--lora", "image:rank=4,alpha=8", "--lora", "audio:rank=4,alpha=8",
        "--lora", "language:rank=4,alpha=8")


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory):
    """Three SGD steps on the mock data (images, clips of 0.1 to 1.3 s) at one rank per module,
    saved; its losses, trained tensors and streamed pieces."""
    return train_reference(folder, tmp_path_factory.mktemp("qwen_omni_training"),
                           *ONE_RANK_EACH, OMNI_TRAIN)


@pytest.mark.timeout(400)
@pytest.mark.multirank
def test_training_starts_from_transformers_loss_on_the_first_batch(trained):
    """Step 1 (the folder's weights) is transformers' thinker loss on the same first global
    batch: its images, its clips of drawn lengths and transformers' own TMRoPE positions."""
    from tests.models.qwen_omni import hf_first_batch_loss

    _, folder, _, (losses, _) = trained
    want = hf_first_batch_loss(folder, 4, 256, (1, 2), 1234)
    print(f"step 1 lm loss {losses[1]:.7f}, transformers {want:.7f}")
    assert abs(losses[1] - want) / want < 1e-5, (losses[1], want)


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_both_encoders_on_grids_of_their_own_colocated_packed_and_language_cp_train_identically(
        trained):
    """The audio tower at TP 2 and the vision tower at DP 2 on ranks of their own with language
    PP 2; the audio tower colocated on the language's DP 2 ranks beside the vision tower on its
    own; packed rows; language CP 2 (TMRoPE positions split by CP): each trains as one rank per
    module does, losses and every trained tensor."""
    from tests.models.hf_vlm import assert_trains_like, sgd_run

    root, folder, _, reference = trained
    cases = (
        ("audio-tp2-vision-dp2-language-pp2", 6,
         ("image:dp=2", "audio:tp=2", "language:pp=2"), ()),
        ("audio-colocated-vision-own", 3, ("image:dp=1", "audio:dp=2@language", "language:dp=2"),
         ()),
        ("packed", 3, ONE_RANK_EACH[0], ("--pack-sequences",)),
        ("language-cp2", 5, ("image:dp=1", "audio:tp=2", "language:cp=2"), ()))
    for name, nproc, grids, extra in cases:
        assert_trains_like(reference, sgd_run(folder, root, name, nproc, grids,
                                              (*OMNI_TRAIN, *extra)), name)


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_lora_on_both_towers_and_the_language_model_trains_identically(folder, tmp_path):
    """LoRA on the vision tower, the audio tower and the language model (the towers'
    projections trained fully) trains the same with both towers at TP 2, the audio tower
    colocated on the language's DP 2 ranks; only adapted linears and the projections move. That
    run's checkpoint exports the merged folder and a PEFT-format one, which ``peft`` puts on
    transformers' whole Omni model to give the merged folder's tensors."""
    from tests.models.qwen_omni import assert_lora_trains_like, peft_folder_difference

    moved = assert_lora_trains_like(
        folder, tmp_path, ONE_RANK_EACH,
        (("image:tp=2", "audio:tp=2@language", "language:dp=2"), 4), (*OMNI_TRAIN, *LORA),
        r"thinker\.(audio_tower\.layers\.\d\.(fc\d|self_attn\.\w+_proj)|"
        r"visual\.blocks\.\d\.(attn\.(q|k|v|proj)|mlp\.\w+_proj)|"
        r"model\.layers\.\d\.(self_attn|mlp)\.\w_?\w*_proj)\.weight$",
        r"thinker\.(audio_tower\.(ln_post|proj)|visual\.merger\.mlp)\.")
    assert any(n.startswith("thinker.audio_tower.layers.") for n in moved)
    assert peft_folder_difference(folder, tmp_path / "out_saved",
                                  "Qwen2_5OmniForConditionalGeneration") < 1e-6


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_two_saving_layouts_export_one_identical_omni_folder_transformers_loads(trained):
    """The trained checkpoint (one rank per module) and the same weights re-saved with the
    audio tower at TP 2 and the language at PP 2 export one folder, byte for byte: the trained
    thinker as the run streamed it, the talker, token2wav and spk_dict.pt unchanged, loaded by
    transformers as the same class."""
    root, folder, pieces, _ = trained
    files, _, _ = export_two_layouts(
        folder, root, pieces, (("image:dp=1", "audio:tp=2", "language:pp=2"), 5), OMNI_TRAIN,
        UNTRAINED, ("thinker.audio_tower.layers.0.self_attn.q_proj.weight",
                    "thinker.audio_tower.proj.weight", "thinker.audio_tower.conv1.weight",
                    "thinker.visual.blocks.0.attn.q.weight", "thinker.visual.merger.mlp.0.weight",
                    "thinker.model.layers.1.mlp.up_proj.weight", "thinker.lm_head.weight"),
        (("thinker.model.audio_tower.layers.1.fc2.weight",
          "thinker.audio_tower.layers.1.fc2.weight"),
         ("thinker.model.visual.blocks.2.attn.v.bias", "thinker.visual.blocks.2.attn.v.bias"),
         ("thinker.model.language_model.embed_tokens.weight",
          "thinker.model.embed_tokens.weight"),
         ("thinker.lm_head.weight", "thinker.lm_head.weight")))
    assert {"model.safetensors", "spk_dict.pt"} <= set(files)
    assert (root / "out_first" / "spk_dict.pt").read_bytes() == (
        folder / "spk_dict.pt").read_bytes()


@pytest.mark.timeout(600)
@pytest.mark.multirank
def test_a_zero_learning_rate_run_exports_the_folder_s_own_bytes(trained):
    """Imported at lr 0 with the audio tower at TP 2 colocated on the language's DP 2 ranks,
    saved and exported: every tensor and spk_dict.pt are the folder's own, bit for bit."""
    from tests.models.hf import safetensors_of
    from tests.models.hf_vlm import export, vlm_train

    root, folder, _, _ = trained
    vlm_train(3, folder, ("image:dp=1", "audio:tp=2@language", "language:dp=2"), (
        *OMNI_TRAIN, "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--save",
        str(root / "still"), "--save-interval", "1"))
    export(root, ("still",))
    written, original = safetensors_of(root / "out_still"), safetensors_of(folder)
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name
    assert (root / "out_still" / "spk_dict.pt").read_bytes() == (
        folder / "spk_dict.pt").read_bytes()


def test_an_omni_folder_with_a_part_not_handled_is_one_line(folder, tmp_path, monkeypatch):
    """A tensor no part maps or carries (a head this import does not know), and an audio
    tower setting Megatron's layers would compute differently, each stop the run in one line
    before any process group."""
    import json

    from tests.models.hf_vlm import bad_input, edited, vlm_flags

    grids = ONE_RANK_EACH[0]
    extra = edited(folder, tmp_path / "extra", tensors={"thinker.extra_head.weight":
                                                        torch.zeros(2, 2)})
    assert bad_input([*vlm_flags(extra, grids), *OMNI_TRAIN], monkeypatch, 3) == (
        f"--hf-model {extra}: 1 tensors belong to no part this qwen2_5_omni import handles "
        "(e.g. thinker.extra_head.weight); training would leave them out and tools/export_hf "
        "would drop them: give a folder of the supported architecture "
        "(Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration) as "
        "transformers saves it")
    thinker = json.loads((folder / "config.json").read_text())["thinker_config"]
    relu = edited(folder, tmp_path / "relu", config={"thinker_config": {
        **thinker, "audio_config": {**thinker["audio_config"], "activation_function": "relu"}}})
    assert bad_input([*vlm_flags(relu, grids), *OMNI_TRAIN], monkeypatch, 3) == (
        f"--encoder-hf-weights audio={relu}: config.json audio_config activation_function "
        "'relu' / scale_embedding False is not supported; supported: gelu, false")


OMNI_ITEMS = [("text", 3), ("video", (4, 16, 16, 2.0)), ("text", 2), ("audio", 13000),
              ("image", (24, 40)), ("video", (3, 21, 30, 3.0)), ("text", 1),
              ("video", (12, 8, 8, 2.0)), ("audio", 1600), ("text", 2)]
"""Text, videos of several frame counts and rates (one whose time passes its rows and columns),
clips and an image, each run between its bos / eos as the Omni processor lays them out."""


def test_tmrope_positions_of_videos_images_and_clips_equal_get_rope_index(folder):
    """Our positions for Qwen2.5-Omni's items (a video's temporal positions at the thinker's
    ``position_id_per_seconds``, the text after it past its last temporal position) equal the
    thinker's ``get_rope_index`` on the same items."""
    import transformers

    from megatron_plugins.data.positions import item_layout, mrope_position_ids
    from megatron_plugins.encoders.qwen2_5_omni_audio import audio_tokens, mel_frames
    from tests.models.hf_vision import plugin

    vision, audio = plugin("qwen2_5_omni_vision", folder), plugin("qwen2_5_omni_audio", folder)
    ours, theirs, layouts, images, videos, seconds, frames = [], [], {IMAGE_TOKEN: [],
                                                                    AUDIO_TOKEN: []}, [], [], [], []
    for kind, value in OMNI_ITEMS:
        if kind == "text":
            ours += list(range(5, 5 + value))
            theirs += list(range(5, 5 + value))
            continue
        encoder, token = (audio, AUDIO_TOKEN) if kind == "audio" else (vision, IMAGE_TOKEN)
        size = (value, 16000) if kind == "audio" else value
        count, grid = item_layout(encoder, size)
        layouts[token].append((count, grid))
        start, end = AUDIO_WRAPPING if kind == "audio" else VISION_WRAPPING
        hf_token = {"audio": AUDIO_TOKEN, "image": IMAGE_TOKEN, "video": VIDEO_TOKEN}[kind]
        ours += [start, *[token] * count, end]
        theirs += [start, *[hf_token] * count, end]
        if kind == "audio":
            frames.append(mel_frames(value, 160, 480000))
            assert count == audio_tokens(frames[-1])
            continue
        merged = torch.tensor([grid[0], grid[1] * 2, grid[2] * 2])
        (videos if kind == "video" else images).append(merged)
        if kind == "video":
            seconds.append(2 / value[3])
    got = mrope_position_ids(torch.tensor(ours), layouts,
                             {IMAGE_TOKEN} if vision.text_after_time else ())
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder)
    model.config.vision_start_token_id = VISION_WRAPPING[0]
    ids = torch.tensor([theirs])
    want, _ = model.model.get_rope_index(ids, torch.stack(images), torch.stack(videos),
                                         torch.ones_like(ids), False, torch.tensor(frames),
                                         torch.tensor(seconds))
    assert torch.equal(got, want[:, 0])
    # 1 s per step at 25 positions a second; 2/3 s at 3 frames a second, truncated
    assert layouts[IMAGE_TOKEN][3][1][3] == (0, 25, 50, 75, 100, 125)
    assert layouts[IMAGE_TOKEN][2][1][3] == (0, 16)
