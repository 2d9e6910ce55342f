"""FastAttention (SDPA) equals the reference attentions, forward and the query, key and value
gradients, fp32 at 1e-5 (bf16: within bf16 tolerance of fp32, no further than the reference in
bf16): causal and bidirectional rows, the data's dense causal mask and another
mask, packed documents, packed images of different sizes, Qwen2.5-VL's windows, GQA, Megatron's
softmax scale with query-key layer scaling, dropout, CP 2 and CP 2 x TP 2; it keeps no score
matrix for the backward; and it is what the local path's specs get unless
``--reference-attention`` asks for the references.

Dropout is checked exactly: on CPU, SDPA with dropout runs its math kernel, which draws the mask
with the same ``dropout`` over the same ``[b, heads, sq, sk]`` probabilities, in the same order,
as the references do, so from the same RNG tracker state both drop the same entries (the fast
attention takes its packed segments one by one, in order, when it drops). On CUDA the fused
kernels draw their own masks; that is not checked here.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders.base import encoder_config, encoder_layer_spec
from megatron_plugins.encoders.qwen2_5_vision import window_order
from megatron_plugins.ops import REFERENCE_ATTENTION
from megatron_plugins.ops.cp_attention import ContextParallelAttention
from megatron_plugins.ops.fast_attention import (
    FastAttention,
    local_core_attention,
    packed_layer_spec,
)
from megatron_plugins.ops.packed_attention import PackedAttention, attend, packed_seq_params
from tests.harness.multiprocess import run_in_processes
from tests.unit_tests.test_cp_attention import PACKED

HEADS, GROUPS, DIM = 4, 2, 8
SEQ, BATCH = 12, 2
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def config(**overrides: object) -> TransformerConfig:
    fields = dict(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                  num_query_groups=GROUPS, attention_dropout=0.0, use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **overrides})


def tensors(rows: tuple[int, ...], groups: int = GROUPS, seed: int = 0) -> list[torch.Tensor]:
    """Query, key, value (``rows`` then heads, dim) and an output gradient."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(*rows, HEADS, DIM), (*rows, groups, DIM), (*rows, groups, DIM), (*rows, HEADS * DIM)]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def forward_backward(attention: torch.nn.Module, inputs: list[torch.Tensor],
                     saved: list[int] | None = None, **kwargs: object) -> list[torch.Tensor]:
    """Output, then the query, key and value gradients of ``(output * upstream).sum()``;
    ``saved`` collects the element count of each tensor the forward keeps for the backward."""
    *qkv, upstream = inputs
    leaves = [t.clone().requires_grad_() for t in qkv]
    sizes = [] if saved is None else saved
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t,
                                                  lambda t: t):
        out = attention(*leaves, kwargs.pop("attention_mask", None), **kwargs)
    out.backward(upstream)
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, mine, theirs in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(mine, theirs, **TOLERANCE, msg=lambda text: f"{name}: {text}")


def qwen_windows() -> list[int]:
    """Qwen2.5-VL's window lengths (patches) for two images and a 2-frame video: full windows
    of 16 patches and cut ones at the right and bottom edges."""
    _, lengths = window_order([(1, 8, 12), (1, 4, 6), (2, 6, 4)], merge=2, window=2)
    return lengths.tolist()


DOCUMENTS = PACKED  # real lengths 5, 1, 9, 3 at padded starts 0, 8, 12, 24, then padding
IMAGES = packed_seq_params(torch.tensor([16, 4, 9, 16, 25, 4]))  # repeated sizes: one product
WINDOWS = packed_seq_params(torch.tensor(qwen_windows()))
CAUSAL_MASK = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ)

# name: (mask type, packing (None: [s, b] rows), key / value groups, config fields, layer number)
CASES = {
    "causal": (AttnMaskType.causal, None, GROUPS, {}, 1),
    "bidirectional": (AttnMaskType.no_mask, None, GROUPS, {}, 1),
    "multi-head": (AttnMaskType.causal, None, HEADS, {"num_query_groups": HEADS}, 1),
    "layer-scaling": (AttnMaskType.causal, None, GROUPS,
                      {"apply_query_key_layer_scaling": True, "softmax_scale": 0.2}, 3),
    "packed-documents": (AttnMaskType.causal, DOCUMENTS, GROUPS, {}, 1),
    "packed-images": (AttnMaskType.no_mask, IMAGES, GROUPS, {}, 1),
    "qwen2.5-windows": (AttnMaskType.no_mask, WINDOWS, GROUPS, {}, 1),
}


def case_inputs(name: str) -> tuple[TransformerConfig, AttnMaskType, list[torch.Tensor], dict]:
    mask, packing, groups, fields, layer = CASES[name]
    rows = (int(packing.cu_seqlens_q_padded[-1] if packing.cu_seqlens_q_padded is not None
                else packing.cu_seqlens_q[-1]),) if packing is not None else (SEQ, BATCH)
    cfg = config(**fields)
    return cfg, mask, tensors(rows, groups), {"packed_seq_params": packing, "layer": layer}


@pytest.mark.parametrize("name", CASES)
def test_equals_the_reference_forward_and_gradients(name: str) -> None:
    cfg, mask, inputs, kwargs = case_inputs(name)
    layer, packing = kwargs["layer"], kwargs["packed_seq_params"]
    softmax_scale = cfg.softmax_scale
    reference = PackedAttention(cfg, layer, mask, "self", softmax_scale=softmax_scale)
    fast = FastAttention(cfg, layer, mask, "self", softmax_scale=softmax_scale)
    want = forward_backward(reference, inputs, packed_seq_params=packing)
    got = forward_backward(fast, inputs, packed_seq_params=packing)
    assert_all_close(got, want)
    if packing is not None and packing.cu_seqlens_q_padded is not None:
        # Padding tokens attend to nothing, as in the reference.
        assert want[0][5:8].abs().max() == 0 and got[0][5:8].abs().max() == 0


@pytest.mark.parametrize("name", ["causal", "packed-documents", "packed-images"])
def test_bf16_is_as_close_to_fp32_as_the_reference_in_bf16(name: str) -> None:
    """bf16 inputs, config and compute: both attentions against the fp32 reference, within
    bf16's usual tolerance, and the fast one no further off than twice the reference's error."""
    cfg, mask, inputs, kwargs = case_inputs(name)
    packing = kwargs["packed_seq_params"]
    exact = forward_backward(PackedAttention(cfg, 1, mask, "self"), inputs,
                             packed_seq_params=packing)
    half = [t.to(torch.bfloat16) for t in inputs]
    cfg16 = config(bf16=True, params_dtype=torch.bfloat16)
    errors = {}
    for kind in (PackedAttention, FastAttention):
        got = forward_backward(kind(cfg16, 1, mask, "self"), half, packed_seq_params=packing)
        for which, mine, want in zip(("output", "dq", "dk", "dv"), got, exact):
            assert mine.dtype == torch.bfloat16, which
            torch.testing.assert_close(mine.float(), want, rtol=1.6e-2, atol=2e-2,
                                       msg=lambda text: f"{kind.__name__} {which}: {text}")
        errors[kind] = max(float((mine.float() - want).abs().max())
                           for mine, want in zip(got, exact))
    assert errors[FastAttention] <= 2 * errors[PackedAttention] + 1e-3, errors


def test_the_datas_dense_causal_mask_and_another_mask_are_honoured() -> None:
    inputs = tensors((SEQ, BATCH))
    causal = forward_backward(PackedAttention(config(), 1, AttnMaskType.causal, "self"), inputs)
    fast = FastAttention(config(), 1, AttnMaskType.causal, "self")
    assert_all_close(forward_backward(fast, inputs, attention_mask=CAUSAL_MASK), causal)
    # Any other mask decides as in DotProductAttention: here each row also hides key 0 but the
    # first query's, per batch row a different extra key.
    masked = CAUSAL_MASK.clone()
    masked[:, :, 1:, 0] = True
    masked[1, :, 6:, 3] = True

    def reference(query, key, value, attention_mask):
        rows = [attend(query[:, b], key[:, b], value[:, b], ~attention_mask[b, 0],
                       softmax_scale=DIM ** -0.5, coeff=None, softmax_in_fp32=True)
                for b in range(BATCH)]
        return torch.stack(rows, dim=1).flatten(2)

    want = forward_backward(reference, inputs, attention_mask=masked)
    assert_all_close(forward_backward(fast, inputs, attention_mask=masked), want)
    assert not torch.allclose(want[0], causal[0], **TOLERANCE)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_keeps_no_score_matrix_for_the_backward(packed: bool) -> None:
    """What autograd keeps: the reference keeps the heads x s x s probabilities, the fast
    attention only tensors linear in s."""
    seq = 64
    rows, params = ((seq,), packed_seq_params(torch.tensor([seq]))) if packed else \
        ((seq, 1), None)
    inputs = tensors(rows)

    def largest_saved(attention: torch.nn.Module) -> int:
        sizes = []
        forward_backward(attention, inputs, sizes, packed_seq_params=params)
        return max(sizes)

    assert largest_saved(PackedAttention(config(), 1, AttnMaskType.causal, "self")) \
        >= HEADS * seq * seq
    assert largest_saved(FastAttention(config(), 1, AttnMaskType.causal, "self")) \
        <= HEADS * seq * DIM
    # GQA: the kernel reads the key and value groups, no copy repeated to the query heads is
    # kept: query, output (heads), key, value (groups), log-sum-exp per head and row (packed:
    # and the segments' token indices).
    kept = []
    forward_backward(FastAttention(config(), 1, AttnMaskType.causal, "self"), inputs, kept,
                     packed_seq_params=params)
    assert sum(kept) <= (2 * HEADS + 2 * GROUPS) * seq * DIM + (HEADS + 4) * seq, kept


def test_the_local_path_gets_the_fast_attention_unless_the_references_are_asked_for() -> None:
    fast, reference = config(transformer_impl="local"), config(transformer_impl="local")
    setattr(reference, REFERENCE_ATTENTION, True)
    assert local_core_attention(fast, packed=False) is FastAttention
    assert local_core_attention(fast, packed=True) is FastAttention
    assert local_core_attention(reference, packed=True) is PackedAttention
    assert local_core_attention(reference, packed=False).__name__ == "DotProductAttention"
    cp = config(context_parallel_size=2)
    setattr(cp, REFERENCE_ATTENTION, True)
    assert local_core_attention(cp, packed=True) is ContextParallelAttention

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    assert core(packed_layer_spec(fast)) is FastAttention
    assert core(encoder_layer_spec(fast)) is FastAttention
    assert core(packed_layer_spec(reference)) is PackedAttention
    # An encoder's config carries the language model's choice.
    grid = SimpleNamespace(tp=1)
    encoder = encoder_config(reference, grid, num_layers=1, hidden_size=16,
                             num_attention_heads=2)
    assert core(encoder_layer_spec(encoder)).__name__ == "DotProductAttention"
    te = config(transformer_impl="transformer_engine")
    assert core(packed_layer_spec(te)) not in (FastAttention, PackedAttention)


def test_the_hf_towers_configs_carry_the_choice_too(tmp_path) -> None:
    """The HF towers set their own norm eps and fusions on top of ``encoder_config``: the choice,
    an attribute and not a field, survives that (``dataclasses.replace`` would drop it, and the
    tower would run the fast attention under ``--reference-attention``)."""
    from tests.models.hf_vision import language_config, plugin, save_tiny
    from tests.models.hf_whisper import plugin as whisper_plugin
    from tests.models.hf_whisper import save_tiny as save_whisper
    from tests.harness.multiprocess import REPO_ROOT

    qwen = plugin("qwen2_5_vl",  # Qwen2.5-VL-7B's config.json alone: no weights needed
                  REPO_ROOT / "examples/mimo/recipes/qwen2_5_vl/qwen2_5_vl_7b_config")
    towers = {"qwen2_5_vl": qwen, "clip": plugin("clip", save_tiny("clip", tmp_path / "clip")),
              "whisper": whisper_plugin(save_whisper(tmp_path / "whisper"))}
    for reference in (True, False):
        language = language_config()
        language.hidden_size = qwen.hf_config.out_hidden_size  # what the merger checks
        setattr(language, REFERENCE_ATTENTION, reference)
        for name, tower in towers.items():
            assert getattr(tower.transformer_config(language), REFERENCE_ATTENTION) is reference, \
                name
        core = packed_layer_spec(qwen.transformer_config(language)).submodules.self_attention \
            .submodules.core_attention
        assert core is (PackedAttention if reference else FastAttention)


def test_reference_attention_is_a_mimo_flag_left_out_of_stocks_arguments() -> None:
    from megatron_plugins.launch.preflight import read_command_line

    line = read_command_line(["--reference-attention", "--num-layers", "2"])
    assert line.flags.reference_attention is True
    assert line.stock_argv == ("--num-layers", "2")
    assert read_command_line([]).flags.reference_attention is False


def test_what_the_fast_attention_cannot_compute_is_refused_in_one_line() -> None:
    from megatron_plugins.model.language import LanguageModelError, _with_attention_choice

    def choose(reference: bool, **fields: object) -> TransformerConfig:
        model = SimpleNamespace(transformer=config(**fields))
        return _with_attention_choice(model, argparse.Namespace(
            reference_attention=reference)).transformer

    assert getattr(choose(True, transformer_impl="local"), REFERENCE_ATTENTION)
    assert not getattr(choose(False, transformer_impl="local"), REFERENCE_ATTENTION)
    with pytest.raises(LanguageModelError, match="drop --reference-attention") as refused:
        choose(True, transformer_impl="transformer_engine")
    assert "\n" not in str(refused.value)
    with pytest.raises(LanguageModelError, match="need --reference-attention"):
        choose(False, transformer_impl="local", window_size=(4, 0))
    with pytest.raises(ValueError, match="need --reference-attention"):
        FastAttention(config(window_size=(4, 0)), 1, AttnMaskType.causal, "self")


def _dropout_rank() -> list[np.ndarray]:
    """One simulated rank: stock DotProductAttention (the data's dense causal mask) and
    PackedAttention (packed documents) against FastAttention, with attention dropout 0.25 in
    training, each pair from the same RNG tracker state; then the fast attention without
    dropout (eval) and a second draw."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    parallel_state.initialize_model_parallel()
    groups = ProcessGroupCollection.use_mpu_process_groups()
    cfg = config(attention_dropout=0.25)
    rows, packed = tensors((SEQ, BATCH)), tensors((32,))
    results = []
    for reference, fast, inputs, kwargs in [
        (DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=groups),
         FastAttention(cfg, 1, AttnMaskType.causal, "self"), rows,
         {"attention_mask": CAUSAL_MASK}),
        (PackedAttention(cfg, 1, AttnMaskType.causal, "self"),
         FastAttention(cfg, 1, AttnMaskType.causal, "self"), packed,
         {"packed_seq_params": DOCUMENTS}),
    ]:
        for attention in (reference, fast):
            tensor_parallel.model_parallel_cuda_manual_seed(7)
            results.append(forward_backward(attention.train(), inputs, **kwargs))
        results.append(forward_backward(fast, inputs, **kwargs))  # the tracker moved on
        results.append(forward_backward(fast.eval(), inputs, **kwargs))
    return [[t.numpy() for t in result] for result in results]


@pytest.mark.multirank
def test_dropout_draws_the_references_mask() -> None:
    [results] = run_in_processes(_dropout_rank, 1, simulated=True, timeout=120)
    results = [[torch.from_numpy(t) for t in result] for result in results]
    for reference, fast, again, undropped in (results[:4], results[4:]):
        assert_all_close(fast, reference)
        # Dropout did drop (a quarter of the probabilities), and anew on the next call.
        assert (fast[0] - undropped[0]).abs().max() > 0.1
        assert (again[0] - fast[0]).abs().max() > 0.1


CP_LAYOUTS = {"rows": None, "documents": DOCUMENTS,
              # One short document, then padding: the second CP rank holds padding only.
              "short": PackedSeqParams(
                  qkv_format="thd",
                  cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor([0, 2, 2], dtype=torch.int32),
                  cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
                  cu_seqlens_kv_padded=torch.tensor([0, 8, 16], dtype=torch.int32),
                  max_seqlen_q=8, max_seqlen_kv=8)}
CP_CASES = [("rows", AttnMaskType.causal), ("rows", AttnMaskType.no_mask),
            ("documents", AttnMaskType.causal), ("documents", AttnMaskType.no_mask),
            ("short", AttnMaskType.causal)]


def _cp_rank(tp: int) -> list[dict[str, object]]:
    """One rank of CP 2 x TP ``tp`` (rank = tp rank x 2 + cp rank): its CP rows of the whole
    sequence and its TP rank's heads, through the reference CP attention and the fast one, for
    every case of CP_CASES; returns both outputs and local gradients, and the element counts the
    fast one saved for backward and got as input."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_plugins.ops.cp_positions import local_positions

    rank = dist.get_rank()
    cp_rank, tp_rank = rank % 2, rank // 2
    cp_groups = [dist.new_group([t * 2, t * 2 + 1]) for t in range(tp)]
    tp_groups = [dist.new_group([t * 2 + c for t in range(tp)]) for c in range(2)]
    groups = ProcessGroupCollection(cp=cp_groups[tp_rank], tp=tp_groups[cp_rank])
    cfg = config(context_parallel_size=2, tensor_model_parallel_size=tp)
    heads, kv_heads = slice(tp_rank * HEADS // tp, (tp_rank + 1) * HEADS // tp), \
        slice(tp_rank * GROUPS // tp, (tp_rank + 1) * GROUPS // tp)
    results = []
    for layout, mask in CP_CASES:
        packed = CP_LAYOUTS[layout]
        total = int(packed.cu_seqlens_q_padded[-1]) if packed is not None else 16
        query, key, value, upstream = tensors((total,) if packed is not None else (total, BATCH))
        upstream = upstream.unflatten(-1, (HEADS, DIM))[..., heads, :].flatten(-2)
        positions = local_positions(total, 2, cp_rank, packed)
        local = [query[positions][..., heads, :], key[positions][..., kv_heads, :],
                 value[positions][..., kv_heads, :], upstream[positions]]
        outcome = {}
        for name, kind in (("reference", ContextParallelAttention), ("fast", FastAttention)):
            attention = kind(cfg, 1, mask, "self", pg_collection=groups)
            saved = []
            outcome[name] = [t.numpy() for t in forward_backward(
                attention, local, saved, packed_seq_params=packed)]
            outcome[f"{name} saved"] = sum(saved)
        outcome["local"] = sum(t.numel() for t in local[:3])
        results.append(outcome)
    return results


@pytest.mark.parametrize("tp", [1, 2], ids=["cp2", "cp2xtp2"])
@pytest.mark.multirank
def test_context_parallel_equals_the_reference_cp_attention(tp: int) -> None:
    ranks = run_in_processes(_cp_rank, 2 * tp, args=(tp,), simulated=True, timeout=240)
    for rank in ranks:
        for (layout, mask), outcome in zip(CP_CASES, rank):
            got = [torch.from_numpy(t) for t in outcome["fast"]]
            want = [torch.from_numpy(t) for t in outcome["reference"]]
            assert_all_close(got, want)
            # Both keep only this rank's query, key and value for the backward.
            assert outcome["fast saved"] == outcome["reference saved"] == outcome["local"], \
                (layout, mask)


def test_the_language_specs_get_it_in_every_attention_layer_without_changing_the_given_spec():
    """A layer spec, each layer of a block spec, a hybrid stack's attention layer; the spec
    given is shared, not changed (stock's default specs are module-level objects)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_plugins.compat.model_build import with_local_hybrid_spec
    from megatron_plugins.model.language import _with_core_attention

    def core(layer):
        return layer.submodules.self_attention.submodules.core_attention

    layer = get_gpt_layer_local_spec()
    stock = core(layer)
    assert core(_with_core_attention(layer, FastAttention)) is FastAttention
    block = TransformerBlockSubmodules(layer_specs=[layer, layer])
    assert [core(each) for each in _with_core_attention(block, FastAttention).layer_specs] == \
        [FastAttention, FastAttention]
    empty = TransformerBlockSubmodules(layer_specs=[])  # a stage without decoder layers
    assert _with_core_attention(empty, FastAttention).layer_specs == []
    hybrid = with_local_hybrid_spec(SimpleNamespace(
        hybrid_stack_spec=None, transformer=config(transformer_impl="local"))).hybrid_stack_spec
    swapped = _with_core_attention(hybrid, FastAttention)
    assert core(swapped.submodules.attention_layer) is FastAttention
    assert swapped.module is hybrid.module
    assert core(layer) is stock and core(hybrid.submodules.attention_layer) is stock
