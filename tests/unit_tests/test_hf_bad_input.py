"""Bad HF input is one clear line before training: missing files, unsupported architectures,
flags that contradict config.json, tensors missing, unused or of the wrong shape or dtype."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_plugins.weights.flags import LANGUAGE_FLAG, check_safetensors, fill_layout_flags
from megatron_plugins.weights.hf_config import find_family, read_config
from megatron_plugins.weights.hf_folder import HFCheckpoint
from megatron_plugins.weights.language_families import FAMILIES
from megatron_plugins.weights.mapping import HFWeightsError
from tests.harness.multiprocess import run_in_processes
from tests.models.hf import BASE_FLAGS, import_errors, save_tiny, stock_args


def test_missing_folder_config_or_safetensors_name_the_flag(tmp_path):
    with pytest.raises(HFWeightsError, match=f"^{LANGUAGE_FLAG} {tmp_path / 'no'}: no such folder$"):
        read_config(tmp_path / "no", LANGUAGE_FLAG)
    with pytest.raises(HFWeightsError, match="no config.json there"):
        read_config(tmp_path, LANGUAGE_FLAG)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(HFWeightsError, match="neither model.safetensors nor "
                                             "model.safetensors.index.json is there"):
        HFCheckpoint(tmp_path, LANGUAGE_FLAG)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(HFWeightsError, match="model-00002-of-00002.safetensors, listed in "
                                             "model.safetensors.index.json, is missing"):
        HFCheckpoint(tmp_path, LANGUAGE_FLAG)


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(HFWeightsError) as error:
        find_family({"architectures": ["GPT2LMHeadModel"]}, FAMILIES, "x/config.json")
    assert str(error.value) == (
        "x/config.json: architecture GPT2LMHeadModel is not supported; supported: "
        "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, "
        "Dots1ForCausalLM, Qwen2_5_VLForConditionalGeneration, "
        "Qwen3VLForConditionalGeneration")


def test_config_features_without_a_mapping_are_refused(tmp_path):
    config = {**json.loads(save_tiny("llama", tmp_path / "m").joinpath("config.json").read_text())}
    for change, needle in (({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
                           ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
                            "rope type 'llama3'"),
                           ({"attention_bias": True}, "attention_bias = True")):
        with pytest.raises(HFWeightsError, match=needle):
            FAMILIES[0].megatron_args({**config, **change})


def test_stock_flags_contradicting_config_json_name_both_values(tmp_path, monkeypatch):
    from megatron_plugins.launch.pretrain import parse_mimo_args

    folder = save_tiny("llama", tmp_path / "m")
    monkeypatch.setenv("WORLD_SIZE", "3")
    base = ["--cpu-simulation", "--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid",
            "language:dp=2", "--micro-batch-size", "1", "--seq-length", "12", "--lr", "1e-3",
            "--train-iters", "1", "--language-hf-weights", str(folder)]
    with pytest.raises(HFWeightsError) as error:
        parse_mimo_args([*base, "--num-layers", "3"])
    assert str(error.value) == (f"--num-layers 3 contradicts --language-hf-weights {folder}/"
                                "config.json, which gives 2; drop --num-layers")
    with pytest.raises(HFWeightsError, match="--normalization LayerNorm contradicts .* gives RMSNorm"):
        parse_mimo_args([*base, "--normalization", "LayerNorm"])


def test_the_pre_import_layout_checks_read_heads_and_experts_from_config_json(tmp_path):
    import argparse

    folder = save_tiny("qwen3_moe", tmp_path / "m")
    args = argparse.Namespace(language_hf_weights=str(folder), num_attention_heads=None,
                              num_experts=None, group_query_attention=False)
    fill_layout_flags(args)
    assert (args.num_attention_heads, args.num_experts, args.group_query_attention) == (4, 4, True)


def _rewrite(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


@pytest.mark.multirank
def test_bad_tensors_are_named_before_training(tmp_path):
    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]

    def extra(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)

    def narrow(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :40].contiguous()

    cases = [
        (_rewrite(save_tiny("llama", tmp_path / "missing"), drop), []),
        (_rewrite(save_tiny("llama", tmp_path / "unused"), extra), []),
        (_rewrite(save_tiny("llama", tmp_path / "shape"), narrow), []),
        (str(save_tiny("llama", tmp_path / "fp32")), ["--bf16"]),
        (str(save_tiny("llama", tmp_path / "bf16", dtype=torch.bfloat16)), ["--fp16"]),
        (str(save_tiny("llama", tmp_path / "widen", dtype=torch.bfloat16)), []),
    ]
    [errors] = run_in_processes(import_errors, 1, args=(cases,), timeout=150, simulated=True)
    where = [f"--language-hf-weights {folder}: " for folder, _ in cases]
    assert errors[0] == (where[0] + "missing HF tensors model.layers.1.mlp.up_proj.weight (e.g. "
                         "model.layers.1.mlp.up_proj.weight for Megatron "
                         "decoder.layers.1.mlp.linear_fc1.weight)")
    assert errors[1] == (where[1] + "HF tensors model.layers.0.self_attn.rotary_emb.inv_freq are "
                         "not used by the llama mapping of this model (a different model, or "
                         "stock flags that contradict config.json)")
    assert errors[2].startswith(where[2] + "model.layers.0.mlp.down_proj.weight [32, 40] do not "
                                "fit Megatron decoder.layers.0.mlp.linear_fc2.weight (shape "
                                "[32, 48] at TP rank 0 of 1")
    assert errors[3] == (where[3] + "model.embed_tokens.weight is float32 but Megatron "
                         "embedding.word_embeddings.weight is bfloat16; copying would change the "
                         "weights: train in the checkpoint's precision (--bf16 / --fp16 / "
                         "neither) or convert it")
    assert "is bfloat16 but Megatron" in errors[4] and "is float16" in errors[4]
    assert errors[5] == ""  # bf16 into fp32 parameters is exact


def test_dots1_configs_megatron_would_route_or_attend_differently_are_refused(tmp_path):
    from megatron_plugins.weights.language_families import DOTS1

    config = json.loads(save_tiny("dots1", tmp_path / "m").joinpath("config.json").read_text())
    sliding = {k: v for k, v in config.items() if k != "layer_types"}
    for change, message in (
        ({"norm_topk_prob": False}, "config.json norm_topk_prob = False is not supported "
         "(Megatron's sigmoid router renormalizes the top-k weights exactly when "
         "num_experts_per_tok > 1); only True can be imported"),
        ({"num_experts_per_tok": 1}, "config.json norm_topk_prob = True is not supported "
         "(Megatron's sigmoid router renormalizes the top-k weights exactly when "
         "num_experts_per_tok > 1); only False can be imported"),
        ({"n_group": 4, "topk_group": 2}, "config.json topk_group = 2 is not supported (Megatron "
         "scores an expert group by its top num_experts_per_tok // topk_group = 1 experts, HF by "
         "its top 2); only values giving 2, or topk_group >= n_group, can be imported"),
        ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
         "config.json layer_types = ['full_attention', 'sliding_attention'] is not supported "
         "(Megatron attention here is full causal, no sliding window); only ['full_attention'] "
         "can be imported"),
        ({**sliding, "sliding_window": 8, "max_window_layers": 1}, "config.json layer_types = "
         "['full_attention', 'sliding_attention'] is not supported"),
    ):
        base = sliding if "max_window_layers" in change else config
        with pytest.raises(HFWeightsError) as error:
            DOTS1.megatron_args({**base, **change})
        assert str(error.value).startswith(message)
    args = stock_args([*BASE_FLAGS, "--language-hf-weights", str(tmp_path / "m")])
    args.moe_layer_freq = [1, 0, 1]
    with pytest.raises(HFWeightsError, match=r"^--moe-layer-freq \[1, 0, 1\]: dots1 has only "
                                             "dense layers first"):
        DOTS1.hf_config(args, 100)


def _safetensors_folder(folder, files):
    """A HF folder whose safetensors ``files`` (name -> bytes) are written as given."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_truncated_or_corrupt_safetensors_are_one_line_naming_the_file(tmp_path):
    save_file({"a": torch.ones(64, 64), "b": torch.ones(8)}, str(tmp_path / "good.safetensors"))
    good = (tmp_path / "good.safetensors").read_bytes()
    header = b'{"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}'
    bad = {
        "half": (good[: len(good) // 2], "incomplete metadata, file not fully covered"),
        "short_header": (good[:20], "invalid header length"),
        "eight_bytes": (good[:4], "header too small"),
        "json": (len(header).to_bytes(8, "little") + header[:-1] + b" " + bytes(64),
                 "invalid JSON in header"),
        "offsets": (len(header).to_bytes(8, "little") + header + bytes(16),
                    "incomplete metadata, file not fully covered"),
    }
    for name, (data, reason) in bad.items():
        folder = _safetensors_folder(tmp_path / name, {"model.safetensors": data})
        with pytest.raises(HFWeightsError) as error:
            check_safetensors(str(folder), LANGUAGE_FLAG)
        assert str(error.value).startswith(f"{LANGUAGE_FLAG} {folder / 'model.safetensors'}: not a "
                                           "readable safetensors file ("), name
        assert reason in str(error.value) and str(error.value).endswith("; copy the folder again")
    sharded = _safetensors_folder(tmp_path / "sharded", {"model-1.safetensors": good,
                                                         "model-2.safetensors": good[:-1]})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
    with pytest.raises(HFWeightsError, match="model-2.safetensors: not a readable safetensors "
                                             "file .*file not fully covered"):
        check_safetensors(str(sharded), "--encoder-hf-weights vision=")
    (sharded / "model.safetensors.index.json").write_text("{")
    with pytest.raises(HFWeightsError, match=r"^--encoder-hf-weights vision= .*index.json: not a "
                                             r"JSON index with a weight_map \("):
        check_safetensors(str(sharded), "--encoder-hf-weights vision=")
    check_safetensors(str(_safetensors_folder(tmp_path / "ok", {"model.safetensors": good})),
                      LANGUAGE_FLAG)


def test_a_truncated_encoder_folder_is_named_by_the_launchs_flag_checks(tmp_path):
    from megatron_plugins.weights.flags import encoder_folders
    from tests.models.hf_vision import plugin
    from tests.models.hf_vision import save_tiny as save_tiny_vision

    folder = save_tiny_vision("clip", tmp_path / "clip", num_hidden_layers=1)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(HFWeightsError) as error:
        encoder_folders({"vision": str(folder)}, {"vision": plugin("clip", folder)})
    assert str(error.value) == (f"--encoder-hf-weights vision= {weights}: not a readable "
                                "safetensors file (Error while deserializing header: incomplete "
                                "metadata, file not fully covered); copy the folder again")
