"""``--lora`` and the per-part optimizer flags: what they mean, and every bad value as one line
before any process group (the pre-import checks; the launch's own checks after Megatron's
parser for what needs the run's other flags)."""

from __future__ import annotations

import argparse

import pytest

from megatron_plugins import cpu_simulation
from megatron_plugins.errors import FlagError, UsageError
from megatron_plugins.launch.preflight import check_parser, check_run
from megatron_plugins.peft.flags import LoraSpec, lora_specs, part_optims

LAYOUT = ["--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:"]


def _args(flags: list[str]) -> tuple[argparse.Namespace, object]:
    args, _ = check_parser().parse_known_args([*LAYOUT, *flags])
    return args, check_run([*LAYOUT, *flags], 2).layout


def test_a_lora_flag_names_a_part_its_rank_alpha_dropout_and_targets():
    args, layout = _args(["--lora", "language:rank=8,alpha=16",
                          "--lora", "vision:rank=4,alpha=4,dropout=0.1,targets=linear_qkv",
                          "--lora", "vision.projection:rank=2,alpha=8"])
    specs = lora_specs(args.lora, layout)
    assert specs["language"] == LoraSpec("language", 8, 16.0, 0.0, (
        "linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2"))
    assert specs["vision"] == LoraSpec("vision", 4, 4.0, 0.1, ("linear_qkv",))
    assert specs["vision.projection"].targets == ("linear_fc1", "linear_fc2")
    assert specs["vision.projection"].scale == 4.0
    # a language model known to have no Gated DeltaNet layers: not theirs
    assert lora_specs(["language:rank=8,alpha=16"], layout, linear_attention=False)[
        "language"].targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def test_per_part_optimizer_flags_are_read_by_part():
    args, layout = _args(["--module-lr", "vision=2e-5", "--module-lr", "vision.projection=1e-4",
                          "--module-min-lr", "vision=2e-6", "--module-weight-decay",
                          "language=0.1"])
    optims = part_optims(args, layout)
    assert (optims["vision"].lr, optims["vision"].min_lr) == (2e-5, 2e-6)
    assert optims["vision.projection"].lr == 1e-4
    assert optims["language"].weight_decay == 0.1 and optims["language"].lr is None


BAD = {
    "rank-zero": (["--lora", "language:rank=0,alpha=8"],
                  "^--lora language:rank=0,alpha=8: rank 0 must be a positive integer"),
    "rank-negative": (["--lora", "vision:rank=-4,alpha=8"],
                      "^--lora vision:rank=-4,alpha=8: rank -4 must be a positive integer"),
    "rank-not-a-number": (["--lora", "language:rank=eight,alpha=8"],
                          "'eight' is not an integer"),
    "alpha-missing": (["--lora", "language:rank=8"], "alpha= is missing"),
    "unknown-key": (["--lora", "language:r=8,alpha=8"], "'r=8' is not rank=, alpha="),
    "key-twice": (["--lora", "language:rank=4,alpha=8,rank=8"], "rank= is given twice"),
    "unknown-target": (["--lora", "vision:rank=4,alpha=8,targets=linear_qkv+q_proj"],
                       "unknown target 'q_proj'; vision's targets are linear_qkv, linear_proj, "
                       "linear_fc1, linear_fc2$"),
    "language-hf-name": (["--lora", "language:rank=4,alpha=8,targets=in_proj_qkv"],
                         "unknown target 'in_proj_qkv'; language's targets are linear_qkv, "
                         "linear_proj, in_proj, out_proj, linear_fc1, linear_fc2$"),
    "projection-target": (["--lora", "vision.projection:rank=4,alpha=8,targets=linear_qkv"],
                          "unknown target 'linear_qkv'; vision.projection's targets are "
                          "linear_fc1, linear_fc2$"),
    "frozen-language": (["--freeze-language-model", "--lora", "language:rank=4,alpha=8"],
                        "^--lora language: language is frozen by --freeze-language-model"),
    "frozen-encoder": (["--freeze-encoder", "vision", "--lora", "vision.projection:rank=4,alpha=8"],
                       "^--lora vision.projection: vision.projection is frozen by "
                       "--freeze-encoder vision"),
    "frozen-projection": (["--freeze-projection", "--lora", "vision.projection:rank=4,alpha=8"],
                          "frozen by --freeze-projection vision"),
    "not-in-layout": (["--lora", "audio:rank=4,alpha=8"],
                      "^--lora audio:rank=4,alpha=8: 'audio' is not a part of this model; parts "
                      "are language, vision, vision.projection$"),
    "twice": (["--lora", "language:rank=4,alpha=8", "--lora", "language:rank=8,alpha=8"],
              "^--lora language is given twice"),
    "lr-unknown-module": (["--module-lr", "audio=1e-4"],
                          "^--module-lr audio=1e-4: 'audio' is not a part of this model; parts "
                          "are language, vision, vision.projection$"),
    "lr-not-a-number": (["--module-lr", "vision=fast"], "'fast' is not a number"),
    "lr-zero": (["--module-lr", "vision=0"], "must be positive"),
    "lr-frozen": (["--freeze-encoder", "vision", "--module-lr", "vision=1e-4"],
                  "^--module-lr vision: vision is frozen by --freeze-encoder vision"),
    "min-above-lr": (["--module-lr", "vision=1e-4", "--module-min-lr", "vision=1e-3"],
                     "^--module-min-lr vision=0.001 is above --module-lr vision=0.0001"),
}


@pytest.mark.parametrize("flags, message", list(BAD.values()), ids=list(BAD))
def test_bad_peft_flags_are_one_line_before_any_import(flags, message):
    with pytest.raises(FlagError, match=message) as error:
        check_run([*LAYOUT, *flags], 2)
    assert "\n" not in str(error.value)


def test_moe_experts_are_adapted_at_expert_tp_1_and_refused_in_one_line_above_it():
    """An MoE language model's experts are targets like any MLP (each routed expert's and the
    shared experts' linear_fc1 / linear_fc2); their adapters need expert TP 1."""
    moe = ["--encoder", "vision=vit", "--grid", "vision:", "--num-experts", "4"]
    check_run([*moe, "--grid", "language:dp=2,ep=2", "--lora", "language:rank=4,alpha=8"], 3)
    check_run([*moe, "--grid", "language:dp=2,etp=2",
               "--lora", "language:rank=4,alpha=8,targets=linear_qkv+linear_proj"], 3)
    with pytest.raises(FlagError, match=(
            "^--lora language: LoRA on MoE experts \\(targets linear_fc1\\+linear_fc2\\) needs "
            "expert TP 1, and --grid language has etp=2; drop etp \\(the experts then split over "
            "ep alone\\) or give targets=linear_qkv\\+linear_proj$")):
        check_run([*moe, "--grid", "language:dp=2,etp=2", "--lora", "language:rank=4,alpha=8"], 3)


LAUNCH = {
    "transformer-engine": (["--transformer-impl", "transformer_engine"],
                           "^--lora adapts the local spec's linear layers; Transformer Engine's "
                           "fused ones are not supported yet: add --transformer-impl local$"),
    "plain-torch-encoder": (["--encoder", "vision=tests.fixtures.plain_encoder:PlainEncoder",
                             "--lora", "vision:rank=4,alpha=8"],
                            "^--lora vision: encoder vision's network \\(PlainMLP\\) is a plain "
                            "torch module"),
    "gated-delta-net-target-without-its-layers": (
        ["--lora", "language:rank=4,alpha=8,targets=linear_qkv+out_proj"],
        "^--lora language:rank=4,alpha=8,targets=linear_qkv\\+out_proj: out_proj is a Gated "
        "DeltaNet linear \\(Qwen3.5's linear attention\\), and this language model has no "
        "Gated DeltaNet layers; its targets are linear_qkv, linear_proj, linear_fc1, linear_fc2$"),
    "module-lr-with-decoupled-lr": (["--module-lr", "vision=1e-4", "--decoupled-lr", "1e-3"],
                                    "^--decoupled-lr and --module-lr both set"),
}


@pytest.mark.parametrize("flags, message", list(LAUNCH.values()), ids=list(LAUNCH))
def test_what_needs_the_runs_other_flags_is_one_line_before_any_process_group(
        flags, message, monkeypatch):
    from megatron_plugins.launch.pretrain import parse_mimo_args
    from tests.models.tiny import TINY_TRANSFORMER

    base = [flag for flag in TINY_TRANSFORMER if flag != "--cpu-simulation"]
    base = [*base[:base.index("--transformer-impl")], *base[base.index("--transformer-impl") + 2:]]
    local = [] if "--transformer-impl" in flags else ["--transformer-impl", "local"]
    encoder = [] if "--encoder" in flags else ["--encoder", "vision=vit"]
    lora = [] if "--lora" in flags or "--module-lr" in flags else [
        "--lora", "language:rank=4,alpha=8"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    # A GPU launch (no --cpu-simulation), even where an earlier test of this process switched
    # the simulation on.
    monkeypatch.setattr(cpu_simulation, "is_active", lambda: False)
    with pytest.raises(UsageError, match=message) as error:
        parse_mimo_args([*base, *local, *encoder, "--grid", "vision:", "--grid", "language:",
                         *lora, *flags])
    assert "\n" not in str(error.value)
    import torch.distributed as dist

    assert not dist.is_initialized()
