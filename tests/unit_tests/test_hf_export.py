"""tools/export_hf.py: checkpoints saved at two layouts export to the same bytes, which
transformers loads back with the trained model's logits; the live stream agrees with the export."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_plugins.weights.streaming import assemble
from tests.models.hf import (
    export_rank,
    hf_logits,
    rel_diff,
    safetensors_of,
    save_tiny,
    train_from_hf,
)
from tests.harness.multiprocess import run_in_processes
from tools import export_hf


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Llama trained 2 steps at language TP2 and saved; the same weights re-saved at PP2
    (loaded, one step at lr 0); both exported, the TP2 one also in 20 kB shards."""
    root = tmp_path_factory.mktemp("export")
    folder = save_tiny("llama", root / "hf")
    tp2, pp2 = root / "tp2", root / "pp2"
    pieces, logits = train_from_hf(3, str(folder), "language:tp=2", (
        "--train-iters", "2", "--save", str(tp2), "--save-interval", "2"))
    train_from_hf(3, str(folder), "language:pp=2", (
        "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--load", str(tp2), "--finetune",
        "--no-load-optim", "--no-load-rng", "--save", str(pp2), "--save-interval", "1"))
    jobs = [(str(tp2), str(root / "out_tp2"), {}), (str(pp2), str(root / "out_pp2"), {}),
            (str(tp2), str(root / "out_sharded"), {"max_shard_size": 20_000, "progress": False})]
    run_in_processes(export_rank, 1, args=(jobs,), timeout=120)
    return root, folder, pieces, logits


@pytest.mark.multirank
def test_two_saving_layouts_export_byte_identical_files(exported):
    root = exported[0]
    files = sorted(p.relative_to(root / "out_tp2") for p in (root / "out_tp2").rglob("*")
                   if p.is_file())
    assert [str(f) for f in files] == ["language/config.json", "language/model.safetensors",
                                       "projections.json", "projections.safetensors"]
    for file in files:
        assert (root / "out_tp2" / file).read_bytes() == (root / "out_pp2" / file).read_bytes(), file


@pytest.mark.multirank
def test_export_loads_in_transformers_with_the_trained_logits_and_dtypes(exported):
    root, folder, _, trained = exported
    language = root / "out_tp2" / "language"
    got = hf_logits(language)
    assert rel_diff(trained[..., :100], got) < 1e-5
    assert rel_diff(hf_logits(folder), got) > 1e-3  # training moved the weights
    config = json.loads((language / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    original = safetensors_of(folder)
    exported_tensors = safetensors_of(language)
    assert {n: (t.shape, t.dtype) for n, t in exported_tensors.items()} == {
        n: (t.shape, t.dtype) for n, t in original.items()}  # fp32 stays fp32, no padded rows


@pytest.mark.multirank
def test_live_stream_equals_what_export_writes(exported):
    root, _, pieces, _ = exported
    streamed = assemble(piece for rank in pieces for piece in rank)
    written = safetensors_of(root / "out_tp2" / "language")
    assert sorted(streamed) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(streamed[name], tensor), name


@pytest.mark.multirank
def test_sharded_export_has_an_index_and_the_same_tensors(exported):
    root = exported[0]
    sharded = root / "out_sharded" / "language"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
    whole = safetensors_of(root / "out_tp2" / "language")
    for file in files:  # no shard holds more than --max-shard-size of tensors
        assert sum(whole[n].numel() * 4 for n, f in index["weight_map"].items() if f == file) <= 20_000
    parts = safetensors_of(sharded)
    assert sorted(parts) == sorted(whole) and all(torch.equal(parts[n], whole[n]) for n in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in whole.values())
    assert rel_diff(hf_logits(sharded), hf_logits(root / "out_tp2" / "language")) == 0


def test_cli_refuses_a_missing_checkpoint_and_a_bad_shard_size_in_one_line(tmp_path, capsys):
    assert export_hf.main(["--checkpoint", str(tmp_path / "none"), "--output",
                           str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"export_hf: error: --checkpoint {tmp_path / 'none'}: no such folder")
    assert export_hf.parse_size("2MiB") == 2 * 2**20
    with pytest.raises(export_hf.HFWeightsError, match="--max-shard-size 5XB"):
        export_hf.parse_size("5XB")


def test_cli_names_checkpoint_not_load_and_what_is_missing(tmp_path, capsys):
    empty, broken = tmp_path / "empty", tmp_path / "broken"
    empty.mkdir()
    (broken / "iter_0000002").mkdir(parents=True)
    fix = ("point --checkpoint at a --save folder holding a complete checkpoint, or at an iter_* "
           "folder")
    for folder, missing in ((empty, f"no checkpoint at {empty}/latest_checkpointed_iteration.txt"),
                            (broken, "no complete checkpoint to resume from (iter_0000002 lack "
                                     "metadata.json: an interrupted save; "
                                     "latest_checkpointed_iteration.txt is absent)")):
        assert export_hf.main(["--checkpoint", str(folder), "--output", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err == (
            f"export_hf: error: --checkpoint {folder}: {missing}; {fix}\n")
    assert export_hf.main(["--checkpoint", str(broken), "--iteration", "3", "--output",
                           str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (f"export_hf: error: --checkpoint {broken} --iteration 3: no "
                                       f"checkpoint at {broken}/iter_0000003\n")


@pytest.mark.multirank
def test_fp32_expert_bias_of_a_bf16_moe_stays_fp32_and_exact_through_training_and_export(tmp_path):
    """dots1 saved in bf16 with its router expert bias in fp32 (as transformers keeps it), trained
    3 steps in --bf16 with a visible bias update rate, saved, streamed live and exported. The rate
    is a power of two: stock takes each step as sign(bf16 token counts) * rate, in bf16."""
    folder = save_tiny("dots1", tmp_path / "hf", dtype=torch.bfloat16)
    rate, bias = 2.0**-7, "model.layers.{}.mlp.gate.e_score_correction_bias"
    pieces, _ = train_from_hf(3, str(folder), "language:dp=2", (
        "--bf16", "--moe-router-bias-update-rate", str(rate), "--train-iters", "3",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "3"))
    run_in_processes(export_rank, 1, args=([(str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                             {"progress": False})],), timeout=120)
    initial, streamed = safetensors_of(folder), assemble(p for rank in pieces for p in rank)
    exported = safetensors_of(tmp_path / "out" / "language")
    assert sorted(exported) == sorted(initial) == sorted(streamed)
    for layer in (1, 2):  # layer 0 is dense
        name = bias.format(layer)
        assert initial[name].dtype == exported[name].dtype == streamed[name].dtype == torch.float32
        assert torch.equal(exported[name], streamed[name]), name
        steps = (exported[name] - initial[name]) / rate
        assert steps.abs().max() > 0.5, name  # training moved the bias...
        # ...by whole sign steps from the exact fp32 value imported: a bf16 rounding anywhere
        # (import, precision wrapper, checkpoint, export) leaves a fraction of a step
        assert (steps - steps.round()).abs().max() < 1e-3, name
    others = {exported[n].dtype for n in exported if "e_score_correction_bias" not in n}
    assert others == {torch.bfloat16}
    config, original = (json.loads((f / "config.json").read_text())
                        for f in (tmp_path / "out" / "language", folder))
    routing = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
               "n_shared_experts", "norm_topk_prob", "routed_scaling_factor", "n_group",
               "topk_group", "first_k_dense_replace", "layer_types", "head_dim", "dtype")
    assert {k: config[k] for k in routing} == {k: original[k] for k in routing}
    assert hf_logits(tmp_path / "out" / "language").shape == (2, 12, 100)  # transformers loads it
