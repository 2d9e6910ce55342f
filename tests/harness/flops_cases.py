"""Every built-in encoder and language family on a real microbatch, forward and backward under
``torch.utils.flop_counter.FlopCounterMode``, next to what :mod:`megatron_plugins.flops` says.

Each ``*_rows`` function runs on one CPU-simulation rank (:func:`tests.harness.multiprocess.
run_in_processes`) and returns a :class:`Row` per case; :func:`table` prints them as the
markdown table of docs/performance.md (``python -m tests.harness.flops_cases``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.harness.flop_counter import counted

BUILT = {}
"""The process groups of this rank, made once (``_groups``)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One case: the formula's hardware FLOPs against FlopCounterMode's count."""

    family: str
    case: str
    formula: int
    counted: int

    @property
    def difference(self) -> float:
        """(formula - counted) / counted, in percent."""
        return 100.0 * (self.formula - self.counted) / self.counted


def table(rows: list[Row], against: str = "FlopCounterMode") -> str:
    """The rows as a markdown table, ``against`` naming the counted side."""
    lines = [f"| family | case | formula (FLOPs) | {against} (FLOPs) | difference |",
             "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {row.family} | {row.case} | {row.formula:,} | {row.counted:,} | "
              f"{row.difference:+.2f}% |" for row in rows]
    return "\n".join(lines)


def _groups() -> Any:
    """One rank's model-parallel groups and seeds, under the CPU simulation."""
    if not BUILT:
        from megatron_plugins.cpu_simulation import patches

        patches.activate()
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.process_groups_config import ProcessGroupCollection

        parallel_state.initialize_model_parallel(1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        BUILT["pgc"] = ProcessGroupCollection.use_mpu_process_groups()
    return BUILT["pgc"]


# --- encoders ---------------------------------------------------------------------------------

def _images(*sizes: tuple[int, int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), np.uint8) for h, w in sizes]


def _encoder_row(family: str, case: str, plugin: Any, media: list[Any], language_hidden: int,
                 freeze: tuple[str, ...] = (), lora: tuple[str, ...] = ()) -> Row:
    """``plugin``'s whole modality (encoder and projection, built from its spec as MiMo does)
    on the collated ``media``; ``freeze``: "encoder" / "projection" parts without gradients;
    ``lora``: parts with rank-2 adapters on all their targets."""
    from megatron_plugins.encoders.counting import microbatch_flops
    from megatron_plugins.media.codec import media_size
    from megatron_plugins.peft.flags import ATTENTION, MLP
    from tests.models.hf_vision import language_config

    language = dataclasses.replace(language_config(), hidden_size=language_hidden)
    config = plugin.transformer_config(language)
    spec = plugin.submodule_spec(config, language_hidden, _groups())
    module = spec.module.from_spec(spec)
    parts = {"encoder": module.encoders, "projection": module.input_projections}
    for part in freeze:
        parts[part].requires_grad_(False)
    adapters = {f"{part}_adapters": _adapt(parts[part], part, MLP if part == "projection"
                                          else ATTENTION + MLP) for part in lora}
    preprocessor = plugin.preprocessor()
    inputs = preprocessor.collate([preprocessor(item) for item in media])
    count = counted(lambda: module(encoder_inputs={plugin.name: inputs}))
    work = microbatch_flops(plugin, [media_size(item) for item in media], config,
                            language_hidden)
    flops = work.flops(encoder_trains=not {"encoder"} & {*freeze, *lora},
                       projection_trains=not {"projection"} & {*freeze, *lora}, **adapters)
    return Row(family, case, flops.hardware, count)


def _adapt(module: torch.nn.Module, part: str, targets: tuple[str, ...]) -> Any:
    """Rank-2 LoRA adapters on ``targets`` of ``module`` (frozen now); their FLOPs' spec."""
    from megatron_plugins.peft.flags import LoraSpec
    from megatron_plugins.peft.layers import adapt

    spec = LoraSpec(part, 2, 4.0, 0.0, targets)
    adapt(module, spec, seed=1)
    return spec.adapters


def flag_plugin(plugin_class: type, provider: str, flags: list[str]) -> Any:
    from megatron_plugins.parallel.layout import ModulePlacement

    parser = argparse.ArgumentParser()
    plugin_class.add_arguments(parser)
    grid = ModulePlacement(name="media", tp=1, pp=1, cp=1, dp=1, rank_offset=0,
                           provider=provider)
    return plugin_class("media", parser.parse_args(flags), grid)


def _audio(seconds: float, seed: int = 0) -> Any:
    from megatron_plugins.media.codec import Waveform

    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, int(16000 * seconds))
    return Waveform(samples.astype(np.float32), 16000)


def encoder_rows(folder: str) -> list[Row]:
    """Every built-in encoder (tiny shapes, HF folders saved under ``folder``) and the example
    custom encoder; the native-resolution ViT also frozen in parts."""
    from megatron_plugins.encoders.audio import AudioFrameEncoder
    from megatron_plugins.encoders.vit import ViTEncoder
    from megatron_plugins.media.codec import Video
    from tests.models.hf_vision import plugin, save_tiny, save_tiny_qwen, save_tiny_siglip2
    from tests.models.hf_whisper import plugin as whisper_plugin
    from tests.models.hf_whisper import save_tiny as save_whisper
    from tests.models.llava_next import save_tiny_llava_next
    from tests.models.qwen_omni import save_tiny_omni
    from tests.models.qwen3_omni import FLOPS_CASES as QWEN3_OMNI_CASES
    from tests.models.qwen3_omni import flops_rows as qwen3_omni_audio_rows
    from tests.models.qwen3_omni import save_tiny as save_qwen3_omni
    from tests.models.qwen3_omni import TEXT_HIDDEN as QWEN3_OMNI_HIDDEN
    from tests.models.qwen3_omni_whole import save_tiny_qwen3_omni
    from tests.models.qwen3_5_whole import TEXT as QWEN3_5_TEXT
    from tests.models.qwen3_5_whole import save_whole
    from tests.models.qwen3_vlm import TEXT as QWEN3_TEXT
    from tests.models.qwen3_vlm import save_tiny_qwen3_vl

    _groups()
    root = Path(folder)
    native = flag_plugin(ViTEncoder, "vit", ["--vit-native-resolution", "--vit-num-layers", "2"])
    sizes = ((20, 30), (16, 16), (37, 11), (64, 80))
    rows = [
        _encoder_row("vit", "3 images, 16 x 16 crops", flag_plugin(ViTEncoder, "vit", []),
                     _images((20, 30), (16, 16), (40, 12)), 24),
        _encoder_row("vit native resolution", "4 images 20x30 16x16 37x11 64x80", native,
                     _images(*sizes), 24),
    ]
    for freeze in (("encoder",), ("projection",), ("encoder", "projection")):
        rows.append(_encoder_row("vit native resolution", f"same, {' + '.join(freeze)} frozen",
                                 native, _images(*sizes), 24, freeze))
    rows.append(_encoder_row("audio", "2 clips, 8 frames",
                             flag_plugin(AudioFrameEncoder, "audio", []),
                             [_audio(0.05), _audio(0.2, seed=1)], 24))
    for provider in ("clip", "siglip"):
        rows.append(_encoder_row(provider, "2 images, 16 x 16", plugin(
            provider, save_tiny(provider, root / provider)), _images((16, 16), (30, 20)), 24))
    siglip2 = plugin("siglip2", save_tiny_siglip2(root / "siglip2"))
    rows.append(_encoder_row("siglip2", "3 images 16x16 40x12 23x37", siglip2,
                             _images((16, 16), (40, 12), (23, 37)), 24))
    qwen = plugin("qwen2_5_vl", save_tiny_qwen(root / "qwen"))
    qwen_media = _images((24, 40), (16, 16), (50, 30), (13, 21), (7, 9))
    rows.append(_encoder_row("qwen2_5_vl", "5 images, window + full layers", qwen, qwen_media,
                             24))
    video = Video(np.random.default_rng(5).integers(0, 256, (3, 21, 30, 3), np.uint8), 2.0)
    rows.append(_encoder_row("qwen2_5_vl", "2 images + a 3-frame video", qwen,
                             [*qwen_media[:2], video], 24))
    qwen3 = plugin("qwen3_vl", save_tiny_qwen3_vl(root / "qwen3"))
    rows.append(_encoder_row("qwen3_vl", "4 images, 2 DeepStack mergers", qwen3,
                             _images((24, 40), (16, 16), (50, 30), (13, 21)),
                             QWEN3_TEXT["hidden_size"]))
    qwen3_5 = plugin("qwen3_5_vl", save_whole(root / "qwen3_5"))
    rows.append(_encoder_row("qwen3_5_vl", "4 images, no DeepStack", qwen3_5,
                             _images((24, 40), (16, 16), (50, 30), (13, 21)),
                             QWEN3_5_TEXT["hidden_size"]))
    llava = plugin("llava_next", save_tiny_llava_next(root / "llava_next"))
    rows.append(_encoder_row("llava_next", "3 images, 3 to 4 anyres crops each", llava,
                             _images((23, 37), (40, 17), (16, 16)), 48))
    whisper = whisper_plugin(save_whisper(root / "whisper"))
    rows.append(_encoder_row("whisper", "2 clips, 100 mel frames", whisper,
                             [_audio(0.4), _audio(1.3, seed=1)], 24))
    omni = save_tiny_omni(root / "qwen2_5_omni", thinker_only=True)
    rows.append(_encoder_row("qwen2_5_omni_vision", "2 images + a 3-frame video",
                             plugin("qwen2_5_omni_vision", omni), [*qwen_media[:2], video], 24))
    rows.append(_encoder_row("qwen2_5_omni_audio", "2 clips of 2 and 3 chunks (82, 132 frames)",
                             plugin("qwen2_5_omni_audio", omni),
                             [_audio(13000 / 16000), _audio(21111 / 16000, seed=1)], 24))
    rows += qwen3_omni_audio_rows(str(save_qwen3_omni(root / "qwen3_omni")[0]),
                                  QWEN3_OMNI_CASES[:1])
    qwen3_omni = save_tiny_qwen3_omni(root / "qwen3_omni_whole", thinker_only=True)
    rows.append(_encoder_row("qwen3_omni_vision", "2 images, 2 DeepStack mergers",
                             plugin("qwen3_omni_vision", qwen3_omni),
                             _images((24, 40), (16, 16)), QWEN3_OMNI_HIDDEN))
    rows.append(_sensor_row())
    return rows


def _sensor_row() -> Row:
    """The example custom encoder of examples/mimo/custom_encoder."""
    import sys

    from tests.harness.multiprocess import REPO_ROOT

    sys.path.insert(0, str(REPO_ROOT / "examples" / "mimo" / "custom_encoder"))
    from sensor_encoder import SensorEncoder

    return _encoder_row("custom (sensor example)", "2 traces, 4 windows",
                        flag_plugin(SensorEncoder, "sensor_encoder:SensorEncoder", []),
                        [_audio(0.001), _audio(0.01, seed=1)], 24)


# --- language models --------------------------------------------------------------------------

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48",
         "--num-attention-heads", "4", "--seq-length", "24", "--max-position-embeddings", "64",
         "--vocab-size", "96", "--make-vocab-size-divisible-by", "1",
         "--position-embedding-type", "rope"]
"""A tiny GPT; later flags of a case override these."""
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
SHARED = ["--moe-shared-expert-intermediate-size", "40", "--moe-shared-expert-gate"]
QWEN3_5 = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq",
           "[1,0]", "--linear-conv-kernel-dim", "4", "--linear-key-head-dim", "8",
           "--linear-value-head-dim", "8", "--linear-num-key-heads", "2",
           "--linear-num-value-heads", "4", "--attention-output-gate", "--kv-channels", "16",
           "--group-query-attention", "--num-query-groups", "2", "--qk-layernorm",
           "--rotary-percent", "0.5", "--swiglu", "--normalization", "RMSNorm"]
"""A tiny Qwen3.5 language model: a Gated DeltaNet layer (two value heads per key head), then
gated attention with partial rotary."""
DOCUMENTS = [5, 9, 3, 4]
PACK = "--pack-sequences"
"""Our flag (not stock's): the language model then runs packed rows."""
BEFORE = "--trained-encoder-before"
"""Not a flag: a gradient reaches the language model's input (dropped before parsing)."""
LONG = ["--seq-length", "150", "--max-position-embeddings", "160"]
"""Rows of 150: three delta-rule chunks of 64, the last partial."""
LANGUAGE_CASES = [
    ("dense", "2 rows of 24", []),
    ("GQA + SwiGLU", "2 rows of 24, 4 heads / 2 groups",
     ["--group-query-attention", "--num-query-groups", "2", "--swiglu"]),
    ("MoE", "top-2 of 4 experts + gated shared expert", [*MOE, *SHARED]),
    ("MoE", "top-1 of 4, MoE every other layer, SwiGLU",
     [*MOE, "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-layer-freq", "[0,1]",
      "--swiglu"]),
    ("packed documents", "1 row: documents 5, 9, 3, 4 + padding 3", ["--pack-sequences"]),
    ("MTP", "1 MTP layer", ["--mtp-num-layers", "1"]),
    ("MTP + MoE", "2 MTP layers after an MoE layer", [*MOE, "--mtp-num-layers", "2"]),
    ("recompute full uniform", "every layer and MTP layer rerun",
     ["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--mtp-num-layers", "1"]),
    ("recompute full block", "first 2 of 3 layers rerun",
     ["--num-layers", "3", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"]),
    ("recompute selective", "core_attn (default)", ["--recompute-granularity", "selective"]),
    ("recompute selective", "core_attn, mlp, shared_experts",
     [*MOE, *SHARED, "--moe-layer-freq", "[0,1]", "--recompute-granularity", "selective",
      "--recompute-modules", "core_attn", "mlp", "shared_experts"]),
    ("frozen", "language frozen, a trained encoder before it", []),
    ("DeepStack", "2 levels added after layers 0 and 1", ["--swiglu"]),
    ("hybrid", "pattern *-*E (attention, MLP, attention, MoE)",
     [*MOE, "--hybrid-layer-pattern", "*-*E", "--num-layers", "4"]),
    ("hybrid", "pattern **-, recompute full uniform",
     ["--hybrid-layer-pattern", "**-", "--num-layers", "3", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("Qwen3.5", "2 rows of 24: Gated DeltaNet, gated attention", QWEN3_5),
    ("Qwen3.5", "2 rows of 150: 3 delta-rule chunks", [*QWEN3_5, *LONG]),
    ("Qwen3.5", "packed: documents 5, 9, 3, 4 + padding 129", [*QWEN3_5, *LONG, PACK]),
    ("Qwen3.5", "a trained encoder before it, recompute full uniform",
     [*QWEN3_5, BEFORE, "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"]),
    ("Qwen3.5 MoE", "top-2 of 4 + gated shared expert, 2 rows of 150",
     [*QWEN3_5, *MOE, *SHARED, *LONG]),
    ("Qwen3.5 MoE", "packed: documents 5, 9, 3, 4 + padding 3", [*QWEN3_5, *MOE, *SHARED, PACK]),
]
"""(family, case, flags) of each language row."""


def _language(flags: list[str]) -> tuple[Any, Any, Any]:
    """A stock GPT built by our language builder from these flags: (model, config, args)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    from megatron_plugins.model.language import StockLanguageModel, language_config_from_args
    from tests.models.hf import BASE_FLAGS, stock_args

    unset_global_variables()
    MTPLossLoggingHelper.tracker.clear()  # sized by the MTP layers of the first model built
    args = stock_args([*BASE_FLAGS, *SHAPE, *(flag for flag in flags
                                                if flag not in (PACK, BEFORE))])
    args.padded_vocab_size = args.vocab_size
    args.pack_sequences = PACK in flags
    set_global_variables(args, build_tokenizer=False)
    config = language_config_from_args(args)
    model = StockLanguageModel(config.transformer, config, _groups(), args.seq_length)
    return model.train(), config.transformer, args


def _language_row(family: str, case: str, flags: list[str], lora: tuple[str, ...] = ()) -> Row:
    """``lora``: rank-2 adapters on these targets (the base frozen); a gradient reaches the
    language model's input in the "frozen" family and with :data:`BEFORE`."""
    from megatron_plugins.flops.language import language_flops
    from megatron_plugins.model.deepstack import DeepStack
    from megatron_plugins.ops.packed_attention import packed_seq_params

    model, config, args = _language(flags)
    length, rows, kwargs = args.seq_length, 2, {"attention_mask": None}
    layout = [[length]] * rows
    if PACK in flags:
        rows, layout = 1, [[*DOCUMENTS, length - sum(DOCUMENTS)]]
        kwargs["packed_seq_params"] = packed_seq_params(torch.tensor(layout[0]))
    else:
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
        kwargs["attention_mask"] = mask.expand(rows, 1, length, length)
    tokens = torch.randint(0, args.vocab_size, (rows, length),
                           generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length).expand(rows, length)
    adapters = _adapt(model, "language", lora) if lora else None
    trains, input_grad = family != "frozen" and not lora, family == "frozen" or BEFORE in flags
    if family == "frozen":
        model.requires_grad_(False)
    if input_grad:
        embedded = model.embedding(tokens, positions).detach().requires_grad_()
        kwargs["decoder_input"] = embedded
    if family == "DeepStack":
        deepstack = DeepStack({"vision": 2}, config.hidden_size)
        deepstack.hook_layers(model)
        deepstack.additions = [torch.randn(length, rows, config.hidden_size, requires_grad=True)
                               for _ in range(2)]
    count = counted(lambda: model(tokens, positions, labels=tokens, **kwargs))
    flops = language_flops(config, args.padded_vocab_size, layout, trains=trains,
                           input_grad=input_grad, pattern=args.hybrid_layer_pattern,
                           adapters=adapters)
    return Row(family, case, flops.hardware, count)


def language_rows() -> list[Row]:
    """Every case of :data:`LANGUAGE_CASES`."""
    _groups()
    return [_language_row(*case) for case in LANGUAGE_CASES]


STOCK_SHAPE = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704",
               "--num-attention-heads", "8", "--seq-length", "2048",
               "--max-position-embeddings", "2048", "--vocab-size", "1000"]
STOCK_CASES = [
    ("dense", []),
    ("GQA + SwiGLU", ["--group-query-attention", "--num-query-groups", "2", "--swiglu"]),
    ("MoE top-2 of 8 + shared", [*MOE, "--num-experts", "8", "--moe-ffn-hidden-size", "128",
                                 "--moe-shared-expert-intermediate-size", "256"]),
]
"""Larger GPTs (no model built) whose model FLOPs stock ``--log-throughput`` also counts."""


def stock_rows() -> list[Row]:
    """Stock's ``num_floating_point_operations`` (a causal-skipping kernel's half of the scores,
    no router) as the "counted" side, our model FLOPs on the flash kernel as the formula, for 2
    rows of 2048 tokens."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.training import num_floating_point_operations

    from megatron_plugins.flops.language import language_flops
    from megatron_plugins.flops.transformer import AttentionKernel
    from tests.models.hf import BASE_FLAGS, stock_args

    rows = []
    for case, flags in STOCK_CASES:
        args = stock_args([*BASE_FLAGS, *STOCK_SHAPE, *flags])
        args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args,
                                                         logging_enabled=False)
        ours = language_flops(core_transformer_config_from_args(args), args.padded_vocab_size,
                              [[args.seq_length]] * 2, kernel=AttentionKernel.FLASH)
        rows.append(Row("stock --log-throughput", case, ours.model,
                        int(num_floating_point_operations(args, 2))))
    return rows


def main() -> None:
    """Print docs/performance.md's table: every family on one simulated rank each."""
    import tempfile

    from tests.harness.multiprocess import run_in_processes

    with tempfile.TemporaryDirectory() as folder:
        [encoders] = run_in_processes(encoder_rows, 1, args=(folder,), timeout=600,
                                      simulated=True)
    [language] = run_in_processes(language_rows, 1, timeout=600, simulated=True)
    [stock] = run_in_processes(stock_rows, 1, timeout=300, simulated=True)
    print(table(encoders + language))
    print()
    print(table(stock, "stock"))


if __name__ == "__main__":
    main()
