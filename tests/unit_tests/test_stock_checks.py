"""Stock Megatron's own flag checks (``validate_args``, ``TransformerConfig.__post_init__``) reached
from a MiMo command line: each failure is one line naming the flags and the fix, before any process
group, as the launch parses (``launch.stock_checks``; one it does not explain is quoted:
test_run_settings.py); and what stock refuses only once it trains (MoE at language TP > 1 without
--sequence-parallel) is one line before ``train()`` starts anything."""

from __future__ import annotations

import pytest

from megatron_plugins.errors import UsageError
from tests.harness.mimo_runs import TINY_MIMO


def _without(*flags: str) -> list[str]:
    """The tiny run without ``flags`` and the value each takes."""
    argv = list(TINY_MIMO)
    for flag in flags:
        at = argv.index(flag)
        valued = at + 1 < len(argv) and not argv[at + 1].startswith("--")
        del argv[at:at + 1 + valued]
    return argv


def _layout(grid: str) -> list[str]:
    return ["--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid", f"language:{grid}"]


def _ranks(grid: str) -> int:
    """The world size of the vision rank and the language ``grid``."""
    size = 1
    for part in grid.split(","):
        key, _, value = part.partition("=")
        if key in ("tp", "pp", "cp", "dp"):
            size *= int(value)
    return 1 + size


@pytest.fixture(autouse=True)
def simulated():
    """The CPU simulation's torch (stock validation reads the device at language tp or cp > 1)."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()


def _error(monkeypatch, argv: list[str], grid: str) -> str:
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", str(_ranks(grid)))
    with pytest.raises(UsageError) as error:
        parse_mimo_args([*argv, *_layout(grid)])
    assert "\n" not in str(error.value)
    return str(error.value)


SAVE = ["--save", "/nonexistent/ckpt"]

CASES = {
    # Precision.
    "fp16-and-bf16": ("dp=2", [*TINY_MIMO, "--fp16", "--bf16"],
                      "--fp16 and --bf16 are both given; keep one (the precision the model trains "
                      "in)"),
    "fp16-cross-entropy": ("dp=2", [*TINY_MIMO, "--fp16-lm-cross-entropy"],
                           "--fp16-lm-cross-entropy needs --fp16; add --fp16 or drop "
                           "--fp16-lm-cross-entropy"),
    "fp32-residual": ("dp=2", [*TINY_MIMO, "--fp32-residual-connection"],
                      "--fp32-residual-connection needs --fp16 or --bf16; add one or drop "
                      "--fp32-residual-connection"),
    "fp8-param-gather": ("dp=2", [*TINY_MIMO, "--fp8-param-gather",
                                  "--use-distributed-optimizer"],
                         "--fp8-param-gather needs --fp8-format (e4m3 or hybrid); add it or drop "
                         "--fp8-param-gather"),
    # The distributed optimizer, overlapped communication.
    "param-gather-needs-distributed-optimizer": (
        "dp=2", [*TINY_MIMO, "--overlap-param-gather"],
        "--overlap-param-gather needs --use-distributed-optimizer; add it or drop "
        "--overlap-param-gather"),
    "param-gather-needs-grad-reduce": (
        "dp=2", [*TINY_MIMO, "--overlap-param-gather", "--use-distributed-optimizer"],
        "--overlap-param-gather needs --overlap-grad-reduce; add --overlap-grad-reduce or drop "
        "--overlap-param-gather"),
    "tp-comm-overlap": ("dp=2", [*TINY_MIMO, "--tp-comm-overlap"],
                        "--tp-comm-overlap needs --sequence-parallel; add it or drop "
                        "--tp-comm-overlap"),
    # Batch sizes.
    "no-micro-batch": ("dp=2", _without("--micro-batch-size"),
                       "--micro-batch-size is missing; give the samples per microbatch (e.g. "
                       "--micro-batch-size 1)"),
    "micro-batch-0": ("dp=2", [*TINY_MIMO, "--micro-batch-size", "0"],
                      "--micro-batch-size 0 must be at least 1"),
    "global-batch-0": ("dp=2", [*TINY_MIMO, "--global-batch-size", "0"],
                       "--global-batch-size 0 must be at least 1"),
    "global-batch": ("dp=2", [*TINY_MIMO, "--global-batch-size", "6"],
                     "--global-batch-size 6 (or --eval-global-batch-size, when given) is not a "
                     "multiple of --micro-batch-size 2 (or --eval-micro-batch-size) x --grid "
                     "language: dp=2; give whole microbatches per data-parallel replica"),
    # The model's shape.
    "no-num-layers": ("dp=2", _without("--num-layers"),
                      "--num-layers is missing; stock's language model needs it"),
    "no-hidden-size": ("dp=2", _without("--hidden-size"),
                       "--hidden-size is missing; stock's language model needs it"),
    "hidden-vs-heads": ("dp=2", [*TINY_MIMO, "--hidden-size", "66"],
                        "--hidden-size 66 is not a multiple of --num-attention-heads 4; choose one "
                        "that is, or give each head's width with --kv-channels"),
    "heads-vs-tp": ("tp=3", [*TINY_MIMO, "--num-attention-heads", "4"],
                    "--grid language: tp=3 does not divide --num-attention-heads 4; choose tp in "
                    "{1, 2, 4}"),
    "query-groups-vs-tp": ("tp=4", [*TINY_MIMO, "--num-attention-heads", "8",
                                    "--group-query-attention", "--num-query-groups", "3"],
                           "--grid language: tp=4 is neither a multiple nor a divisor of "
                           "--num-query-groups 3; choose tp in {1}"),
    "seq-vs-positions": ("dp=2", [*TINY_MIMO, "--seq-length", "64"],
                         "--seq-length 64 is longer than --max-position-embeddings 32; raise "
                         "--max-position-embeddings to 64 or shorten --seq-length"),
    "gqa-and-mla": ("dp=2", [*TINY_MIMO, "--multi-latent-attention", "--group-query-attention",
                             "--num-query-groups", "2"],
                    "--group-query-attention and --multi-latent-attention exclude each other; "
                    "keep one"),
    "mrope-section": ("dp=2", [*TINY_MIMO, "--position-embedding-type", "mrope"],
                      "--position-embedding-type mrope needs --mrope-section T H W (each head's "
                      "rotary frequency pairs for time, height and width)"),
    "relative-positions": ("dp=2", [*TINY_MIMO, "--position-embedding-type", "relative"],
                           "--position-embedding-type relative needs --transformer-impl "
                           "transformer_engine"),
    # Context parallelism.
    "cp-seq-length": ("cp=2", [*TINY_MIMO, "--seq-length", "30"],
                      "--seq-length 30 is not a multiple of 4: --grid language: cp=2 cuts every "
                      "row into 2 x cp = 4 equal context-parallel chunks; choose --seq-length 28 "
                      "or 32"),
    # Pipeline stages.
    "layers-vs-pp": ("pp=2", [*TINY_MIMO, "--num-layers", "3"],
                     "--num-layers 3 does not split evenly over the 2 pipeline stages of --grid "
                     "language: pp=2; give a multiple of 2 layers or another pp"),
    "virtual-stage-layers": ("pp=2", [*TINY_MIMO, "--num-layers", "4",
                                      "--num-layers-per-virtual-pipeline-stage", "3"],
                             "--num-layers-per-virtual-pipeline-stage 3 does not divide the "
                             "layers of each pipeline stage (--num-layers 4 over --grid language: "
                             "pp=2); choose a divisor"),
    "virtual-stages-at-pp1": ("dp=2", [*TINY_MIMO, "--num-layers-per-virtual-pipeline-stage", "1"],
                              "an interleaved pipeline schedule "
                              "(--num-layers-per-virtual-pipeline-stage or "
                              "--num-virtual-stages-per-pipeline-rank) needs --grid language: pp "
                              "above 1, not pp=1; drop the flag or give more pipeline stages"),
    "first-stage-layers": ("dp=2", [*TINY_MIMO, "--decoder-first-pipeline-num-layers", "1"],
                           "--decoder-first-pipeline-num-layers / "
                           "--decoder-last-pipeline-num-layers leave 1 of --num-layers 2 for 0 "
                           "middle pipeline stages (--grid language: pp=1); give counts that leave "
                           "no stage without layers and no layers without a stage"),
    "middle-stage-layers": ("pp=4", [*TINY_MIMO, "--num-layers", "6",
                                     "--decoder-first-pipeline-num-layers", "1"],
                            "--decoder-first-pipeline-num-layers / "
                            "--decoder-last-pipeline-num-layers leave 5 layers, which do not split "
                            "evenly over the 3 middle pipeline stages of --grid language: pp=4; "
                            "change the counts"),
    # Recomputation.
    "selective-with-method": ("dp=2", [*TINY_MIMO, "--recompute-granularity", "selective",
                                       "--recompute-method", "uniform"],
                              "--recompute-method uniform is for --recompute-granularity full; "
                              "drop it (selective recomputation takes --recompute-modules)"),
    "full-without-method": ("dp=2", [*TINY_MIMO, "--recompute-granularity", "full"],
                            "--recompute-granularity full needs --recompute-method uniform or "
                            "block (and --recompute-num-layers N)"),
    "full-without-layers": ("dp=2", [*TINY_MIMO, "--recompute-granularity", "full",
                                     "--recompute-method", "uniform"],
                            "--recompute-granularity full needs --recompute-num-layers N, from 1 "
                            "to the 2 layers of each pipeline stage"),
    "selective-with-layers": ("dp=2", [*TINY_MIMO, "--recompute-granularity", "selective",
                                       "--recompute-num-layers", "1"],
                              "--recompute-num-layers is for --recompute-granularity full; drop it "
                              "(selective recomputation takes --recompute-modules)"),
    "recompute-moe-act": ("dp=2", [*TINY_MIMO, "--recompute-granularity", "selective",
                                   "--recompute-modules", "moe_act"],
                          "--recompute-modules moe_act needs --moe-grouped-gemm (a GPU with "
                          "Transformer Engine); drop moe_act"),
    "recompute-mla": ("dp=2", [*TINY_MIMO, "--recompute-granularity", "selective",
                               "--recompute-modules", "mla_up_proj"],
                      "--recompute-modules mla_up_proj needs --multi-latent-attention; drop "
                      "mla_up_proj"),
    "distribute-at-tp1": ("dp=2", [*TINY_MIMO, "--distribute-saved-activations",
                                   "--recompute-granularity", "full", "--recompute-method",
                                   "uniform", "--recompute-num-layers", "1"],
                          "--distribute-saved-activations spreads recomputed activations over "
                          "tensor-parallel ranks, which --grid language: tp=1 does not have; drop "
                          "it or give the language tp > 1"),
    "distribute-selective": ("tp=2", [*TINY_MIMO, "--distribute-saved-activations",
                                      "--recompute-granularity", "selective"],
                             "--distribute-saved-activations needs --recompute-granularity full"),
    "distribute-without-method": ("tp=2", [*TINY_MIMO, "--distribute-saved-activations",
                                           "--recompute-granularity", "full"],
                                  "--distribute-saved-activations needs --recompute-method uniform "
                                  "or block"),
    # Mixture of experts.
    "experts-vs-ep": ("dp=4,ep=4", [*TINY_MIMO, "--num-experts", "6"],
                      "--num-experts 6 is not divisible by --grid language: ep=4; choose ep in "
                      "{1, 2}"),
    "expert-tp-with-bias": ("tp=2,etp=2", [*TINY_MIMO, "--num-experts", "4"],
                            "--grid language: etp=2 splits each expert over tensor-parallel ranks, "
                            "which stock's MoE does only without linear biases (on by default); "
                            "add --disable-bias-linear or give etp=1"),
    "top1-softmax": ("dp=2", [*TINY_MIMO, "--num-experts", "4", "--moe-router-topk", "1"],
                     "--moe-router-topk 1 with the softmax router needs --moe-router-pre-softmax "
                     "(a softmax over the one chosen expert has no gradient); add it"),
    "expert-size-without-experts": ("dp=2", [*TINY_MIMO, "--moe-ffn-hidden-size", "32"],
                                    "--moe-ffn-hidden-size 32 sizes MoE experts, but the language "
                                    "model has none; add --num-experts N or drop "
                                    "--moe-ffn-hidden-size"),
    "expert-bias-softmax": ("dp=2", [*TINY_MIMO, "--num-experts", "4",
                                     "--moe-router-enable-expert-bias"],
                            "--moe-router-enable-expert-bias needs --moe-router-score-function "
                            "sigmoid or sqrtsoftplus, not softmax"),
    "pad-without-capacity": ("dp=2", [*TINY_MIMO, "--num-experts", "4",
                                      "--moe-pad-expert-input-to-capacity"],
                             "--moe-pad-expert-input-to-capacity needs "
                             "--moe-expert-capacity-factor X"),
    "capacity-with-sinkhorn": ("dp=2", [*TINY_MIMO, "--num-experts", "4",
                                        "--moe-expert-capacity-factor", "1.0",
                                        "--moe-router-load-balancing-type", "sinkhorn"],
                               "--moe-expert-capacity-factor needs "
                               "--moe-router-load-balancing-type aux_loss, seq_aux_loss, "
                               "global_aux_loss or none, not sinkhorn"),
    "router-groups": ("dp=2", [*TINY_MIMO, "--num-experts", "4", "--moe-router-num-groups", "3",
                               "--moe-router-group-topk", "1"],
                      "--num-experts 4 is not divisible by --moe-router-num-groups 3; choose a "
                      "group count that divides it"),
    "router-group-topk": ("dp=2", [*TINY_MIMO, "--num-experts", "4", "--moe-router-num-groups",
                                   "2", "--moe-router-group-topk", "3"],
                          "--moe-router-group-topk 3 is more than --moe-router-num-groups 2; "
                          "choose at most 2 groups"),
    "router-group-topk-alone": ("dp=2", [*TINY_MIMO, "--num-experts", "4",
                                         "--moe-router-group-topk", "1"],
                                "--moe-router-group-topk needs --moe-router-num-groups N"),
    # The learning-rate schedule and the run's length.
    "min-lr-above-lr": ("dp=2", [*TINY_MIMO, "--min-lr", "1", "--lr", "0.5"],
                        "--min-lr 1.0 is above --lr 0.5; the learning rate decays from --lr down "
                        "to --min-lr"),
    "iterations-and-samples": ("dp=2", [*TINY_MIMO, "--train-samples", "80"],
                               "--train-samples 80 and --train-iters 10 are both given; give one"),
    "decay-in-samples": ("dp=2", [*TINY_MIMO, "--lr-decay-samples", "80"],
                         "--lr-decay-samples counts samples, but --train-iters 10 counts "
                         "iterations; give --lr-decay-iters instead"),
    "warmup-in-iterations": ("dp=2", [*_without("--train-iters", "--train-iters"),
                                      "--train-samples", "80", "--lr-warmup-iters", "2"],
                             "--lr-warmup-iters counts iterations, but --train-samples 80 counts "
                             "samples; give --lr-warmup-samples instead"),
    "warmup-twice": ("dp=2", [*TINY_MIMO, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
                     "--lr-warmup-fraction and --lr-warmup-iters are both given; keep one"),
    "weight-decay-ends": ("dp=2", [*TINY_MIMO, "--weight-decay-incr-style", "linear"],
                          "--weight-decay-incr-style linear needs --start-weight-decay and "
                          "--end-weight-decay"),
    "weight-decay-ends-constant": ("dp=2", [*TINY_MIMO, "--start-weight-decay", "0.1"],
                                   "--start-weight-decay / --end-weight-decay need "
                                   "--weight-decay-incr-style linear or cosine (constant keeps "
                                   "--weight-decay)"),
    # Checkpoints and logging.
    "save-without-interval": ("dp=2", [*TINY_MIMO, *SAVE],
                              "--save /nonexistent/ckpt needs --save-interval N (the iterations "
                              "between checkpoints)"),
    "save-interval-0": ("dp=2", [*TINY_MIMO, *SAVE, "--save-interval", "0"],
                        "--save-interval 0 must be at least 1"),
    "retain-interval": ("dp=2", [*TINY_MIMO, *SAVE, "--save-interval", "5",
                                 "--save-retain-interval", "3"],
                        "--save-retain-interval 3 must be a multiple of --save-interval 5"),
    "memory-log-interval": ("dp=2", [*TINY_MIMO, "--log-memory-interval", "3", "--log-interval",
                                     "2"],
                            "--log-memory-interval 3 must be a multiple of --log-interval 2"),
    # Sequence parallelism (the CPU simulation runs it).
    "distribute-and-sequence-parallel": (
        "tp=2", [*TINY_MIMO, "--distribute-saved-activations", "--sequence-parallel",
                 "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"],
        "--distribute-saved-activations and --sequence-parallel exclude each other; keep one"),
}
"""Flag combinations a MiMo launch can give, by id: (language grid, command line, the one line)."""


@pytest.mark.parametrize("case", CASES)
def test_a_stock_check_is_one_line_naming_the_flags(monkeypatch, case):
    grid, argv, line = CASES[case]
    assert _error(monkeypatch, argv, grid) == line


GPU_CASES = {
    "rope-fusion": ("dp=2", [*_without("--no-rope-fusion"), "--position-embedding-type", "rope"],
                    "RoPE fusion (stock's default with --position-embedding-type rope) needs "
                    "Transformer Engine >= 1.4, which is not installed here; add --no-rope-fusion"),
    "permute-fusion": ("dp=2", [*TINY_MIMO, "--num-experts", "4", "--moe-permute-fusion"],
                       "--moe-permute-fusion needs Transformer Engine >= 2.1, which is not "
                       "installed here; drop --moe-permute-fusion"),
    "fp8-moe": ("dp=2", [*TINY_MIMO, "--num-experts", "4", "--fp8-format", "hybrid", "--bf16"],
                "this run needs Transformer Engine >= 1.7.0, which is not installed here (stock: "
                "Only transformer-engine>=1.7.0 supports MoE FP8 training, but your version is "
                "0.0.0.); install it or drop the flag that asks for it"),
    "device-connections": ("tp=2", TINY_MIMO,
                           "--grid language: tp=2, cp=1 on this GPU needs the environment "
                           "variable CUDA_DEVICE_MAX_CONNECTIONS=1 (stock orders tensor- and "
                           "context-parallel communication by launch); export "
                           "CUDA_DEVICE_MAX_CONNECTIONS=1 before torchrun"),
}
"""What only a GPU launch reaches (its flags the CPU simulation refuses or replaces first), on a
machine without Transformer Engine; by id: (language grid, command line, the one line)."""


@pytest.mark.parametrize("case", GPU_CASES)
def test_a_gpu_launchs_stock_check_is_one_line_naming_the_flags(monkeypatch, case):
    from megatron_plugins import cpu_simulation

    monkeypatch.setattr(cpu_simulation, "is_active", lambda: False)
    if case == "device-connections":
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    grid, argv, line = GPU_CASES[case]
    assert _error(monkeypatch, argv, grid) == line


MOE_TP2 = [*TINY_MIMO, "--num-experts", "4"]


@pytest.mark.parametrize("simulated_run", [True, False], ids=["cpu-simulation", "gpu"])
def test_moe_at_language_tp_without_sequence_parallel_stops_before_any_process_group(
        monkeypatch, simulated_run):
    """Parsing builds it (weights in and out need no sequence parallelism); training refuses it
    in one line before ``start`` brings up torch.distributed."""
    from megatron_plugins import cpu_simulation
    from megatron_plugins.launch import pretrain

    monkeypatch.setattr(cpu_simulation, "is_active", lambda: simulated_run)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    run = pretrain.parse_mimo_args([*MOE_TP2, *_layout("tp=2")])

    def start(_run):
        raise AssertionError("start() reached")

    monkeypatch.setattr(pretrain, "start", start)
    with pytest.raises(UsageError) as error:
        pretrain.train(run)
    assert str(error.value) == (
        "the MoE language model (4 experts) at --grid language: tp=2 needs --sequence-parallel to "
        "train (stock's MoE layers refuse tensor parallelism without it); add --sequence-parallel")
