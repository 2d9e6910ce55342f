"""Workloads for the advisor's tests, built from model shapes without torch: a language config
with ``TransformerConfig`` field names, and the published Qwen3.5-VL 27B operating point.

Qwen3.5-VL 27B (HF ``Qwen/Qwen3.5-27B``; transformers' ``qwen3_5`` config): 64 decoder layers of
hidden 5120, MLP 17408 (SwiGLU), 24 query heads and 4 key/value heads of 256 in its full-attention
layers (with an output gate), vocabulary 248320, untied embeddings; three of every four layers are
Gated DeltaNet, counted here as gated attention of the same width (the launch cannot build Gated
DeltaNet yet: issue 41). Vision tower: 27 layers of hidden 1152, MLP 4304, 16 heads, 16-pixel
patches (2 frames each) merged 2x2 into the language's 5120 by a 4608-wide MLP. Megatron-Bridge's
tutorial trains it on RDR (one 768x768 image per sample: 2304 patches, 576 positions).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from megatron_plugins.flops.count import EncoderFlops
from megatron_plugins.flops.encoder import embedding, projection, tower
from megatron_plugins.parallel.layout import ModulePlacement
from megatron_plugins.performance.candidates import HOMOGENEOUS, SEPARATE, Candidate, \
    EncoderPlacement, Space
from megatron_plugins.performance.gpus import Hardware
from megatron_plugins.performance.workload import EncoderWork, LanguageWork, \
    TransformerShape, Workload

QWEN35_VOCAB = 248320


def language_config(**fields: Any) -> SimpleNamespace:
    """A language model's config by ``TransformerConfig`` field names (a small GPT by default)."""
    config = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=None,
                  kv_channels=None, ffn_hidden_size=1024, gated_linear_unit=False,
                  num_moe_experts=None, moe_layer_freq=1, moe_router_topk=2,
                  moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None,
                  moe_shared_expert_gate=False, transformer_impl="transformer_engine",
                  recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                  recompute_modules=None, mtp_num_layers=None, pipeline_model_parallel_size=1,
                  virtual_pipeline_model_parallel_size=None, attention_output_gate=False)
    config.update(fields)
    return SimpleNamespace(**config)


def vision_work(name: str, config: SimpleNamespace, patches: int, tokens: int, merged: int,
                language_hidden: int, pixels_per_patch: int) -> EncoderWork:
    """An encoder of ``config`` embedding one item per sample: ``patches`` through its layers,
    merged to ``tokens`` rows of ``merged`` width projected to ``language_hidden``."""
    counted = EncoderFlops(embedding(patches, pixels_per_patch, config.hidden_size)
                           + tower(config, [patches]),
                           projection(tokens, merged, merged, language_hidden,
                                      config.transformer_impl))
    shape = TransformerShape.of(config)
    params = shape.params + merged * merged + merged * language_hidden
    return EncoderWork(name, shape, params, counted.flops(), patches, tokens, language_hidden,
                       trained_params=params)


def small_workload(global_batch: int = 16, **language: Any) -> Workload:
    """A small MiMo model: a 4-layer GPT of hidden 256 and a 2-layer ViT of 256 patches."""
    config = language_config(**language)
    encoder = language_config(num_layers=2, hidden_size=128, num_attention_heads=4,
                              ffn_hidden_size=512)
    work = vision_work("vision", encoder, 256, 256, 128, config.hidden_size, 3 * 16 * 16)
    lm = LanguageWork(config, 1024, 512, 400, embedding_params=1024 * config.hidden_size)
    return Workload(lm, (work,), global_batch, distributed_optimizer=True)


def qwen35_27b(seq_length: int, global_batch: int, image_side: int = 768,
               text_tokens: int = 200) -> Workload:
    """Qwen3.5-VL 27B fine-tuned on one ``image_side`` square image per sample (rows padded to
    ``seq_length``, bf16, distributed optimizer with overlapped gradient reduction)."""
    config = language_config(num_layers=64, hidden_size=5120, num_attention_heads=24,
                             num_query_groups=4, kv_channels=256, ffn_hidden_size=17408,
                             gated_linear_unit=True, attention_output_gate=True)
    vision = language_config(num_layers=27, hidden_size=1152, num_attention_heads=16,
                             ffn_hidden_size=4304)
    patches = (image_side // 16) ** 2
    work = vision_work("images", vision, patches, patches // 4, 4 * 1152, 5120, 3 * 2 * 16 * 16)
    lm = LanguageWork(config, QWEN35_VOCAB, seq_length, patches // 4 + text_tokens,
                      embedding_params=QWEN35_VOCAB * 5120, output_params=QWEN35_VOCAB * 5120)
    return Workload(lm, (work,), global_batch, distributed_optimizer=True,
                    overlap_grad_reduce=True)


def space(workload: Workload, hardware: Hardware, heads: int, encoder_heads: int,
          name: str = "images") -> Space:
    """What to enumerate for ``workload`` (one encoder) on ``hardware``."""
    config = workload.language.config
    return Space(heads=heads, layers=config.num_layers, encoder_heads={name: encoder_heads},
                 providers={name: "qwen3_vl"}, experts=0, global_batch=workload.global_batch,
                 gpus_per_node=hardware.gpus_per_node, fewest=hardware.fewest_gpus,
                 most=hardware.gpus,
                 checks=dict(num_attention_heads=heads,
                             num_query_groups=config.num_query_groups,
                             group_query_attention=config.num_query_groups is not None,
                             num_experts=None, tensor_parallel_num_weight_shards=None,
                             expert_tensor_parallel_num_weight_shards=None,
                             seq_length=workload.language.seq_length, pack_sequences=False,
                             cp_comm_type=None, hybrid_context_parallel=False,
                             balance_encoder_work=False))


class _Placed:
    """Module placements by name: a layout as another framework ranks it (the language model
    first), which this project's ``ParallelLayout`` refuses but the cost model can price."""

    def __init__(self, *modules: ModulePlacement) -> None:
        self.modules = {module.name: module for module in modules}

    def module(self, name: str) -> ModulePlacement:
        return self.modules[name]


def bridge_layouts(tp: int = 4, pp: int = 2, dp: int = 2) -> tuple[Candidate, Candidate]:
    """Megatron-Bridge's tutorial layouts: the homogeneous baseline (the image encoder in the
    first stage of language TP4 PP2 DP2, 16 ranks) and the heterogeneous one (the same language
    ranks 0-15, the image encoder alone on rank 16)."""
    language = ModulePlacement(name="language", tp=tp, pp=pp, cp=1, dp=dp, rank_offset=0)
    baseline = Candidate(language, (EncoderPlacement("images", "qwen3_vl", HOMOGENEOUS, tp, dp),),
                         1, False)
    images = ModulePlacement(name="images", provider="qwen3_vl", tp=1, pp=1, cp=1, dp=1,
                             rank_offset=language.size)
    separate = Candidate(language, (EncoderPlacement("images", "qwen3_vl", SEPARATE, 1, 1),), 1,
                         False, layout=_Placed(language, images))
    return baseline, separate
