"""The advisor on a two-tower model, the Qwen3-Omni-30B-A3B thinker of the recipe's config-only
folder: clips given in seconds are counted by the AuT tower's own formula (long clips priced in
full), the layout it picks on eight H200s moves with the data's clips, and ``mimo-plan --gpu``
prices Megatron-Bridge's 8-GPU preset with and without its optimizer CPU offload."""

from __future__ import annotations

import re
from typing import Any

import pytest

from megatron_plugins.compat import planning
from megatron_plugins.errors import FlagError
from tests.harness.multiprocess import REPO_ROOT

pytestmark = pytest.mark.timeout(600)  # the launch's parse, once for the module

FOLDER = REPO_ROOT / "examples" / "mimo" / "recipes" / "qwen3_omni" / "qwen3_omni_30b_a3b_config"
RUN = ["--hf-model", str(FOLDER), "--seq-length", "4096", "--micro-batch-size", "1",
       "--global-batch-size", "32", "--bf16", "--use-distributed-optimizer", "--lr", "1e-5",
       "--train-iters", "10"]
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
DATA = ["--advise-items-per-sample", "image=1", "--advise-item-tokens", "image=576"]


@pytest.fixture(scope="module")
def omni() -> Any:
    """The recipe's run parsed as the advisor parses it (8 H100s, optimizer state on the CPU)."""
    from megatron_plugins.launch.advise import advisor_flags, plan_inputs

    own, rest = advisor_flags(["--gpus", "8", "--gpu", "h100-sxm", *RUN, *OFFLOAD, *DATA,
                               "--advise-clip-seconds", "audio=20"])
    with planning.transformer_engine_assumed():
        return own, plan_inputs(own, rest)


def _workload(planned: Any, clips: float, seconds: float) -> tuple[Any, Any]:
    """The data and work of ``clips`` clips of ``seconds`` per sample beside one image."""
    from megatron_plugins.launch.advise_workload import describe_data, run_workload

    run = planned.run
    run.args.advise_items_per_sample = ["image=1", f"audio={clips:g}"]
    run.args.advise_clip_seconds = [f"audio={seconds:g}"]
    data = describe_data(run.args, run.plugins, run.source, None)
    return data, run_workload(run.args, run.plugins, data)


def test_clips_in_seconds_are_counted_by_the_towers_formula_and_long_ones_in_full(omni):
    from megatron_plugins.encoders.qwen3_omni_audio import audio_tokens

    _, planned = omni
    data, _ = _workload(planned, 2, 20)
    assert planned.providers == {"image": "qwen3_omni_vision", "audio": "qwen3_omni_audio"}
    # 20 s: 2000 mel frames in 100-frame chunks of 13 positions each.
    assert data.encoders["audio"].item_tokens == ((audio_tokens(2000, 100), 1),) == ((260, 1),)
    assert data.lines()[2] == ("  audio: 2.00 items per sample of 260.0 positions on average "
                               "(clips of 20 s, counted by the encoder)")
    # Clips longer than a minute (Qwen3-Omni's processor does not cut them) cost in proportion.
    flops = {seconds: _workload(planned, 1, seconds)[1].encoder("audio").flops.model
             for seconds in (60, 120)}
    assert flops[120] / flops[60] == pytest.approx(2.0, rel=0.02)


@pytest.mark.parametrize("flags, message", [
    (["--advise-clip-seconds", "image=3"],
     "--advise-clip-seconds image=3: encoder image (qwen3_omni_vision) takes images, not clips; "
     "give --advise-item-tokens image=T"),
    (["--advise-item-tokens", "audio=40", "--advise-clip-seconds", "audio=3"],
     "--advise-item-tokens audio=40 and --advise-clip-seconds audio=3: give one of them"),
])
def test_a_clip_length_for_no_clips_or_twice_described_is_one_line(omni, flags, message):
    from megatron_plugins.launch.advise_workload import describe_data

    own, planned = omni
    args = planned.run.args
    for name in ("advise_items_per_sample", "advise_item_tokens", "advise_clip_seconds"):
        setattr(args, name, [])
    for flag, value in zip(flags[::2], flags[1::2]):
        getattr(args, flag[2:].replace("-", "_")).append(value)
    with pytest.raises(FlagError) as error:
        describe_data(args, planned.run.plugins, planned.run.source, None)
    assert str(error.value) == message


BRIDGE_8 = ["--grid", "image:tp=1,dp=8@language", "--grid", "audio:tp=1,dp=8@language",
            "--grid", "language:tp=1,pp=1,dp=8,ep=8"]
"""Megatron-Bridge's 8-GPU preset (TP 1 PP 1 EP 8, both towers beside every language replica),
as this project launches it."""


def test_bridges_8_gpu_preset_fits_only_with_its_optimizer_state_on_the_cpu(omni):
    """``mimo-plan --gpu`` prices the preset's ranks with the state offloaded (it fits an
    H100), and the same layout with the state on the GPU does not fit."""
    from megatron_plugins.launch.advise import layout_memory
    from megatron_plugins.launch.advise_workload import run_workload
    from megatron_plugins.launch.preflight import check_run
    from megatron_plugins.performance.assumptions import Assumptions
    from megatron_plugins.performance.candidates import layout_candidate
    from megatron_plugins.performance.gpus import hardware
    from megatron_plugins.performance.memory import candidate_memory

    _, planned = omni
    argv = [*RUN, *OFFLOAD, *BRIDGE_8]
    layout = check_run(argv, 8, quiet=True).layout
    line = layout_memory(["--gpu", "h100-sxm", *DATA, "--advise-clip-seconds", "audio=20",
                          *argv], layout, 1, 8)
    assert line.startswith("memory per rank (GiB, the advisor's model; h100-sxm: 79.2 GiB, "
                           "69.3 usable, optimizer state 100% on the CPU): language stage 0 ")
    assert line.endswith("; fits")
    run = planned.run
    run.args.optimizer_cpu_offload = False
    try:
        on_gpu = run_workload(run.args, run.plugins, planned.data)
    finally:
        run.args.optimizer_cpu_offload = True
    assert on_gpu.optimizer_offloaded == 0 and planned.workload.optimizer_offloaded == 1
    memory = candidate_memory(layout_candidate(layout, 1, False, False), on_gpu,
                              hardware(8, 8, "h100-sxm", {}), Assumptions())
    assert not memory.fits and set(memory.ranks) == {"language stage 0"}


H200_8 = ["--advise", "--gpus", "8", "--gpu", "h200", "--advise-top", "1"]
AUDIO_ON_LANGUAGE_RANKS = ["--grid", "image:tp=1,dp=8@language", "--grid",
                           "audio:tp=2,dp=4@language", "--grid",
                           "language:tp=1,pp=1,cp=1,dp=8,ep=8", "--micro-batch-size", "4"]
"""Both towers on the language ranks (audio over TP 2 x DP 4), micro-batches of 4."""
TOWERS_ON_OWN_RANKS = ["--grid", "image:tp=1,dp=1", "--grid", "audio:tp=1,dp=1", "--grid",
                       "language:tp=1,pp=3,cp=1,dp=2", "--micro-batch-size", "1"]
"""Each tower on one rank of its own, the language model on six (PP 3 x DP 2)."""


def _rows(report: str) -> dict[str, tuple[str, float, list[str]]]:
    """The advisor's first and given rows: label -> (its line, tokens/s/GPU, its flags after
    the ``--encoder`` pairs)."""
    lines = report.splitlines()
    rows = {}
    for index, line in enumerate(lines):
        if line.startswith(("1. ", "given")):
            tokens = re.search(r", ([\d,]+) tokens/s/GPU", lines[index + 1]).group(1)
            flags = lines[index + 4].removeprefix("    flags: ").split()
            rows[line.split()[0]] = line, float(tokens.replace(",", "")), flags[4:]
    return rows


@pytest.mark.parametrize("clips, seconds, pick, other", [
    (1, 5, AUDIO_ON_LANGUAGE_RANKS, TOWERS_ON_OWN_RANKS),
    (3, 60, TOWERS_ON_OWN_RANKS, AUDIO_ON_LANGUAGE_RANKS),
], ids=["one-5s-clip", "three-60s-clips"])
def test_the_layout_picked_moves_with_the_clips(capsys, clips, seconds, pick, other):
    """On eight H200s, one short clip per sample keeps the audio tower on the language ranks,
    three minute-long ones move both towers to ranks of their own. The other case's pick, given
    on the command line, fits memory and is priced below the pick: the clips move the pricing."""
    from megatron_plugins.launch.advise import main

    data = ["--advise-items-per-sample", f"audio={clips}", "--advise-clip-seconds",
            f"audio={seconds}"]
    assert main([*H200_8, *RUN, *OFFLOAD, *DATA, *data, *other]) == 0
    rows = _rows(capsys.readouterr().out)
    _, picked, flags = rows["1."]
    line, given, given_flags = rows["given"]
    assert (flags, given_flags) == (pick, other)
    assert "does NOT fit" not in line and picked > given


LORA = ["language:rank=16,alpha=32", "image:rank=16,alpha=32", "audio:rank=16,alpha=32"]
"""Rank-16 LoRA on both towers and the language model (attention and every expert)."""


def test_lora_is_priced_as_frozen_weights_and_trained_adapters(omni):
    """With LoRA the advisor prices what trains: the adapters (10.2M parameters outside the
    experts, 629M on the 6,144 experts) and the towers' projections, no weight gradient of a
    frozen weight (a language step's FLOPs three quarters of full fine-tuning's), no state for
    frozen weights: Bridge's 8-GPU layout, which full fine-tuning fits only with the optimizer
    state on the CPU, fits an H100 with it on the GPU."""
    from megatron_plugins.launch.advise_workload import run_workload
    from megatron_plugins.launch.preflight import check_run
    from megatron_plugins.performance.assumptions import Assumptions
    from megatron_plugins.performance.candidates import layout_candidate
    from megatron_plugins.performance.gpus import hardware
    from megatron_plugins.performance.memory import candidate_memory

    _, planned = omni
    args = planned.run.args
    saved = args.lora, args.optimizer_cpu_offload
    args.optimizer_cpu_offload = False
    try:
        works = {}
        for name, lora in (("lora", LORA), ("full", [])):
            args.lora = lora
            works[name] = run_workload(args, planned.run.plugins, planned.data)
    finally:
        args.lora, args.optimizer_cpu_offload = saved
    adapted, full = works["lora"].language, works["full"].language
    assert not adapted.trains and adapted.adapter_params == (10_223_616, 629_145_600)
    ratio = adapted.microbatch_flops(1, False).model / full.microbatch_flops(1, False).model
    assert 2 / 3 < ratio < 0.8  # 0.75: attention's scores need both gradients either way
    for name in ("image", "audio"):
        tower, whole = works["lora"].encoder(name), works["full"].encoder(name)
        assert 0 < tower.trained_params < whole.trained_params / 3, name  # the projections
    candidate = layout_candidate(check_run([*RUN, *BRIDGE_8], 8, quiet=True).layout, 1, False,
                                 False)
    memory = {name: candidate_memory(candidate, work, hardware(8, 8, "h100-sxm", {}),
                                     Assumptions()) for name, work in works.items()}
    assert memory["lora"].fits and not memory["full"].fits
