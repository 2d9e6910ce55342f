"""A whole HF VLM (a tiny Qwen2.5-VL) fine-tuned with LoRA: checkpoints, resume, learning rates
per part, and the export that transformers and peft load.

LoRA on the language model, the vision tower and the merger (the projection), a learning rate of
their own for the tower and the merger, 4 Adam steps at one rank per module, saved every 2. The
checkpoint leaves the frozen base out (the folder it came from is referenced) and is a fraction of
a full fine-tune's; resuming from iteration 2 gives iterations 3-4 and the trained adapters bit
for bit; the learning rate of every part is in the log and in TensorBoard; ``tools/export_hf``
writes the merged folder, whose transformers logits are ours, and the adapters in PEFT's format,
which ``peft.PeftModel.from_pretrained`` puts on transformers' model of the original folder to
give our logits too (within 1e-5, fp32). A resume that would not continue the checkpoint (other
adapters, other learning rates, another base) is one line before any process group.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.models.hf import rel_diff, safetensors_of, train_then
from tests.models.hf_vlm import bad_input, vlm_flags, whole_pieces
from tests.harness.multiprocess import run_in_processes
from tests.models.qwen_vlm import (
    IMAGE_TOKEN,
    VOCAB,
    hf_logits,
    images,
    sample,
    sample_logits,
    save_tiny_qwen_vl,
)
from tests.harness.tensorboard_scalars import read_scalars

pytestmark = pytest.mark.multirank

TOLERANCE = 1e-5
GRIDS = ("image:dp=1", "language:dp=1")
LORA = ("--lora", "language:rank=4,alpha=8", "--lora", "image:rank=4,alpha=8",
        "--lora", "image.projection:rank=2,alpha=4")
PART_LR = ("--module-lr", "image=2e-3", "--module-lr", "image.projection=5e-3")
"""The run's --lr is 1e-3 (tests.models.hf.MIMO_FLAGS): the tower twice, the merger 5 times."""
RATE_LINE = "learning rate per part:"
ADAPTED = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|attn\.(qkv|proj)|"
                     r"merger\.mlp\.[02])\.weight$")
"""The HF weights LoRA adapts here: every attention and MLP linear, the merger's two."""


def _observe(session: Any, model: Any, ids: torch.Tensor, pictures: list) -> dict[str, Any]:
    """The trained module's trainable parameters, our logits on the sample, streamed pieces."""
    trained = {name: p.detach().numpy().copy() for name, p in model.named_parameters()
               if p.requires_grad}
    return {"trained": trained, "logits": sample_logits(session, model, ids, pictures),
            "pieces": whole_pieces(model, session)}


def lora_rank(argv: list[str], ids: torch.Tensor, pictures: list) -> dict[str, Any]:
    """One rank of a training run from the whole folder (the entry point's code path); its
    printed log lines naming every part's learning rate come back too."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train_then(argv, functools.partial(_observe, ids=ids, pictures=pictures))
    result["rate_lines"] = [line for line in printed.getvalue().splitlines() if RATE_LINE in line]
    return result


def _train(folder: Path, ids: torch.Tensor, pictures: list, flags: tuple[str, ...]) -> list:
    from tests.models.hf import pieces_from

    argv = [*vlm_flags(folder, GRIDS), "--mock-items-per-sample", "1:2",
            "--make-vocab-size-divisible-by", "1", *flags]
    results = run_in_processes(lora_rank, 2, args=(argv, ids, pictures), timeout=900,
                               simulated=True)
    for result in results:
        result["pieces"] = pieces_from(result["pieces"])
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """The folder; the LoRA run (4 steps, saved at 2 and 4), its resume from iteration 2, and a
    full fine-tune of 2 steps saved, for the size."""
    root = tmp_path_factory.mktemp("lora_vlm")
    folder = save_tiny_qwen_vl(root / "qwen")
    pictures = images()
    ids = sample(folder, pictures)
    lora = _train(folder, ids, pictures, (*LORA, *PART_LR, "--save", str(root / "lora"),
                                          "--save-interval", "2", "--tensorboard-dir",
                                          str(root / "tb_lora")))
    resumed = _train(folder, ids, pictures, (*LORA, *PART_LR, "--load", str(root / "lora"),
                                             "--ckpt-step", "2", "--tensorboard-dir",
                                             str(root / "tb_resumed")))
    full = _train(folder, ids, pictures, ("--train-iters", "2", "--save", str(root / "full"),
                                          "--save-interval", "2"))
    return {"root": root, "folder": folder, "ids": ids, "pictures": pictures, "lora": lora,
            "resumed": resumed, "full": full}


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _tensor_bytes(folder: Path) -> int:
    """Bytes of the tensors (model and optimizer state) a checkpoint holds."""
    from megatron.core import dist_checkpointing

    return sum(int(np.prod(tensor.global_shape)) * tensor.dtype.itemsize
               for tensor in dist_checkpointing.load_tensors_metadata(str(folder)).values())


@pytest.mark.timeout(2400)
def test_a_resumed_lora_run_continues_bit_identically(runs):
    root = runs["root"]
    first = read_scalars(root / "tb_lora", "lm loss")
    again = read_scalars(root / "tb_resumed", "lm loss")
    assert sorted(again) == [3, 4]
    assert [again[i] for i in (3, 4)] == [first[i] for i in (3, 4)]
    for trained, resumed in zip(runs["lora"], runs["resumed"]):
        assert trained["trained"].keys() == resumed["trained"].keys()
        for name, value in trained["trained"].items():
            np.testing.assert_array_equal(resumed["trained"][name], value, name)
    language = next(r for r in runs["lora"] if r["module"] == "language")["trained"]
    assert language and all(".lora_" in name for name in language)


def test_the_checkpoint_holds_the_adapters_and_references_the_frozen_base(runs):
    from megatron.core import dist_checkpointing

    root = runs["root"]
    iteration = root / "lora" / "iter_0000004"
    keys = set(dist_checkpointing.load_tensors_metadata(str(iteration)))
    model = {key for key in keys if not key.startswith("optimizer.")}
    assert model and all(key.rpartition(".")[2] in ("lora_a", "lora_b") for key in model), model
    assert any("input_projections" in key for key in model)  # the merger's adapters
    args = dist_checkpointing.load_common_state_dict(str(iteration))["args"]
    assert sorted(args.peft_base) == ["image", "image.projection", "language"]
    assert {ref["path"] for ref in args.peft_base.values()} == {str(runs["folder"])}
    full_iteration = root / "full" / "iter_0000002"
    lora, full = _size(iteration), _size(full_iteration)
    lora_state, full_state = _tensor_bytes(iteration), _tensor_bytes(full_iteration)
    print(f"\nLoRA checkpoint {lora} bytes ({lora_state} in tensors), full fine-tune "
          f"checkpoint {full} bytes ({full_state} in tensors)")
    assert lora < full / 2 and lora_state < full_state / 4


def test_every_parts_learning_rate_is_in_the_log_and_in_tensorboard(runs):
    root = runs["root"]
    rates = {part: read_scalars(root / "tb_lora", f"learning-rate/{part}")
             for part in ("language", "image", "image.projection")}
    stock = read_scalars(root / "tb_lora", "learning-rate")
    for iteration in range(1, 5):
        language = rates["language"][iteration]
        assert language == pytest.approx(stock[iteration])
        # one scheduler shape: each part's rate in proportion to its maximum
        assert rates["image"][iteration] == pytest.approx(2 * language, rel=1e-6)
        assert rates["image.projection"][iteration] == pytest.approx(5 * language, rel=1e-6)
    assert rates["language"][1] != rates["language"][4]  # the schedule moved
    [language_rank] = [r for r in runs["lora"] if r["module"] == "language"]
    assert len(language_rank["rate_lines"]) == 4
    last = language_rank["rate_lines"][-1]
    for part, values in rates.items():
        assert f"{part} {values[4]:.6E}" in last, last


@pytest.fixture(scope="module")
def exported(runs) -> Path:
    from tests.models.hf import export_checkpoints

    out = runs["root"] / "out"
    export_checkpoints([(str(runs["root"] / "lora"), str(out), {"progress": False})], timeout=300)
    return out


def test_the_merged_export_gives_our_logits_in_transformers(runs, exported):
    from megatron_plugins.weights.streaming import assemble

    [ours] = [r["logits"] for r in runs["lora"] if r["logits"] is not None]
    folder = runs["folder"]
    merged = hf_logits(exported, runs["ids"], runs["pictures"])
    assert rel_diff(ours[..., :VOCAB], merged) < TOLERANCE
    assert rel_diff(ours[..., :VOCAB], hf_logits(folder, runs["ids"], runs["pictures"])) > 1e-3
    written, original = safetensors_of(exported), safetensors_of(folder)
    assert sorted(written) == sorted(original)
    streamed = assemble(piece for rank in runs["lora"] for piece in rank["pieces"])
    for name, tensor in written.items():  # the streaming API merges the same way
        torch.testing.assert_close(tensor, streamed[name], rtol=1e-6, atol=1e-7, msg=name)
    for name, tensor in written.items():  # exactly the adapted linears' weights changed
        assert (not torch.equal(tensor, original[name])) == bool(ADAPTED.search(name)), name


def test_the_peft_adapters_on_transformers_model_give_our_logits(runs, exported):
    import json

    import peft
    import transformers

    from tests.models.hf_vision import qwen_processor

    adapters = exported / "adapters"
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["rank_pattern"] and set(config["rank_pattern"].values()) == {2}  # the merger
    folder, ids, pictures = runs["folder"], runs["ids"], runs["pictures"]
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapters)
    inputs = qwen_processor(folder)(pictures, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=inputs["pixel_values"],
                       image_grid_thw=inputs["image_grid_thw"],
                       mm_token_type_ids=(ids == IMAGE_TOKEN).int()).logits.numpy()
    [ours] = [r["logits"] for r in runs["lora"] if r["logits"] is not None]
    assert rel_diff(ours[..., :VOCAB], logits) < TOLERANCE


def test_a_resume_that_would_not_continue_the_checkpoint_is_one_line(runs, monkeypatch):
    folder, root = runs["folder"], runs["root"]
    argv = [*vlm_flags(folder, GRIDS), "--make-vocab-size-divisible-by", "1", "--load",
            str(root / "lora")]
    message = bad_input([*argv, *LORA, "--module-lr", "image=1e-3",
                         "--module-lr", "image.projection=5e-3"], monkeypatch)
    assert message.startswith("--module-lr / --module-min-lr / --module-weight-decay give "
                              "image lr 0.001, min lr 0.0001, but --load ")
    assert message.endswith("was trained with image lr 0.002, min lr 0.0002; give the "
                            "checkpoint's, or add --override-opt_param-scheduler to go on with "
                            "the new ones")
    message = bad_input([*argv, "--lora", "language:rank=8,alpha=8", *LORA[2:], *PART_LR],
                        monkeypatch)
    assert message.startswith("--lora language:rank=8,alpha=8,dropout=0,targets=")
    assert "differs from the checkpoint's" in message
    copy = shutil.copytree(folder, root / "qwen_copy")
    moved = [*vlm_flags(copy, GRIDS), "--make-vocab-size-divisible-by", "1", "--load",
             str(root / "lora"), *LORA, *PART_LR]
    message = bad_input(moved, monkeypatch)
    assert f"was trained over image's frozen base --hf-model {folder}" in message
    assert f"but this run's is --hf-model {copy}" in message
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    parse_mimo_args([*argv, *LORA, "--module-lr", "image=1e-3", "--module-lr",
                     "image.projection=5e-3", "--override-opt_param-scheduler"])


def test_an_export_whose_base_folder_changed_is_one_line(runs, tmp_path):
    """Last: it edits the base folder (and puts it back)."""
    from megatron_plugins.weights.mapping import HFWeightsError
    from tools.export_hf import export

    weights = runs["folder"] / "model.safetensors"
    saved = weights.read_bytes()
    try:
        weights.write_bytes(saved[:-8] + bytes(8))
        with pytest.raises(HFWeightsError, match="the checkpoint left image's frozen weights "
                                                 "out, to be read from --hf-model .* which has "
                                                 "changed"):
            export(runs["root"] / "lora", tmp_path / "out", progress=False)
    finally:
        weights.write_bytes(saved)
    import torch.distributed as dist

    assert not dist.is_initialized(), "the export left its one-rank world in the caller"


def test_a_base_from_a_megatron_checkpoint_is_referenced_and_resumes_bit_identically(tmp_path):
    """The tiny vit + GPT, its language model started from a full run's Megatron checkpoint and
    adapted: the LoRA checkpoint leaves that base out, records the checkpoint it came from, and a
    resume from iteration 2 of 4 repeats iterations 3 and 4 bit for bit."""
    from megatron.core import dist_checkpointing

    from tests.harness.mimo_runs import train_mimo

    layout = ("--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:")  # Adam
    short = ("--eval-iters", "0")
    train_mimo(2, layout, extra=(*short, "--train-iters", "1", "--save", str(tmp_path / "base"),
                                 "--save-interval", "1"), timeout=400)
    lora = (*layout, "--language-megatron-checkpoint", str(tmp_path / "base"),
            "--lora", "language:rank=4,alpha=8")
    first, _ = train_mimo(2, lora, extra=(*short, "--train-iters", "4", "--save",
                                          str(tmp_path / "lora"), "--save-interval", "2"),
                          timeout=400)
    again, _ = train_mimo(2, lora, extra=(*short, "--train-iters", "4", "--load",
                                          str(tmp_path / "lora"), "--ckpt-step", "2"),
                          timeout=400)
    assert [again["lm loss"][i] for i in (3, 4)] == [first["lm loss"][i] for i in (3, 4)]
    iteration = tmp_path / "lora" / "iter_0000004"
    keys = [key for key in dist_checkpointing.load_tensors_metadata(str(iteration))
            if key.startswith("language_model.")]
    assert keys and all(key.rpartition(".")[2] in ("lora_a", "lora_b") for key in keys), keys
    args = dist_checkpointing.load_common_state_dict(str(iteration))["args"]
    assert args.peft_base["language"]["flag"] == "--language-megatron-checkpoint"
    assert args.peft_base["language"]["path"] == str(tmp_path / "base" / "iter_0000001")
