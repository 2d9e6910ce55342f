"""The MiMo language model at context parallelism 2 (gloo, CPU simulation) is the cp=1 model:
per-token logits and losses, and parameter gradients summed over the CP ranks (as DDP's dp x cp
reduction does), for RoPE, multimodal RoPE and interleaved multimodal RoPE, one sequence per row
and packed documents. Each model is built by the MiMo builder (``MimoModelBuilder.build_model``:
our language spec, MimoModel's own split of the whole sequence, compat Gaps 19-21). Weights are
drawn large (std 0.3) so that a wrong rotation moves the logits by ~0.5, not 1e-5. Also: what
language CP does not cover is refused in one line."""

from __future__ import annotations

import contextlib
import io
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.harness.multiprocess import run_in_processes

SEQ, BATCH, VOCAB = 16, 2, 64
SECTION = ("4", "2", "2")  # 8 rotary pairs of a 16-dim head
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer", "--lr", "1e-3",
         "--transformer-impl", "local", "--use-cpu-initialization", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--no-gradient-accumulation-fusion",
         "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
         "--no-persist-layer-norm", "--no-bias-swiglu-fusion", "--distributed-backend", "gloo",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--init-method-std", "0.3"]
ROPES = {"rope": ["--position-embedding-type", "rope"],
         "mrope": ["--position-embedding-type", "mrope", "--mrope-section", *SECTION],
         "imrope": ["--position-embedding-type", "mrope", "--mrope-section", *SECTION]}
# Real lengths 7, 3, 10 padded to multiples of 2 x cp (8, 4, 12), then 8 tokens of trailing
# padding as their own segment: 32 tokens.
PACKING = {"cu_seqlens_q": [0, 7, 10, 20, 20], "cu_seqlens_q_padded": [0, 8, 12, 24, 32]}
CASES = [("rope", False), ("rope", True), ("mrope", False), ("mrope", True), ("imrope", False),
         ("imrope", True)]


def _args(rope: str, cp: int, packed: bool):
    from megatron.training.arguments import parse_args, validate_args

    saved, sys.argv = sys.argv, ["test", *FLAGS, *ROPES[rope], "--context-parallel-size", str(cp)]
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    with contextlib.redirect_stdout(io.StringIO()):  # stock prints every argument
        validate_args(args)
    args.padded_vocab_size = VOCAB
    args.pack_sequences = packed
    args.mrope_interleaved = rope == "imrope"
    return args


def _inputs(rope: str, packed: bool) -> dict[str, object]:
    """The whole microbatch every CP rank gets (MimoModel splits it)."""
    generator = torch.Generator().manual_seed(7)
    batch, length = (1, 32) if packed else (BATCH, SEQ)
    tokens = torch.randint(0, VOCAB, (batch, length), generator=generator)
    labels = torch.randint(0, VOCAB, (batch, length), generator=generator)
    loss_mask = torch.ones(batch, length)
    packing = None
    if packed:
        real, padded = PACKING["cu_seqlens_q"], PACKING["cu_seqlens_q_padded"]
        t = torch.cat([torch.arange(end - start) for start, end in zip(padded, padded[1:])])
        for start, end, length_real in zip(padded, padded[1:], np.diff(real)):
            loss_mask[:, start + length_real:end] = 0
        longest = int(np.diff(padded).max())
        packing = {"cu_seqlens_q": torch.tensor(real), "cu_seqlens_kv": torch.tensor(real),
                   "cu_seqlens_q_padded": torch.tensor(padded),
                   "cu_seqlens_kv_padded": torch.tensor(padded),
                   "max_seqlen_q": longest, "max_seqlen_kv": longest}
    else:
        t = torch.arange(length)
    positions = t[None].expand(batch, length)
    if rope != "rope":
        # Image-like rows: height and width ids differ from the temporal one.
        positions = torch.stack([positions, positions // 2 + 1, positions % 3])
    return {"input_ids": tokens, "position_ids": positions.contiguous(), "labels": labels,
            "loss_mask": loss_mask, "packing_kwargs": packing}


def _model(topology, rope: str, cp: int, packed: bool):
    from megatron_plugins.model.builder import MimoBuildConfig, MimoModelBuilder
    from megatron_plugins.model.language import language_config_from_args
    from megatron_plugins.parallel.layout import LANGUAGE
    from megatron_plugins.parallel.rng import seed_module

    seed_module(topology, LANGUAGE, 1234, SimpleNamespace(
        data_parallel_random_init=False, te_rng_tracker=False, inference_rng_tracker=False,
        cuda_graph_impl="none"))
    language = language_config_from_args(_args(rope, cp, packed))
    return MimoModelBuilder(MimoBuildConfig(language=language, _topology=topology)).build_model()


def _run(model, inputs: dict[str, object]) -> dict[str, np.ndarray]:
    """Logits and per-token loss of this rank's tokens, and its parameter gradients."""
    captured = []
    hook = model.language_model.output_layer.register_forward_hook(
        lambda module, args, output: captured.append(output[0]))
    kwargs = dict(inputs)
    if kwargs["packing_kwargs"] is not None:
        kwargs["packing_kwargs"] = dict(kwargs["packing_kwargs"])
    loss, loss_mask = model(attention_mask=None, **kwargs)
    hook.remove()
    (loss * loss_mask).sum().backward()
    return {"logits": captured[0].detach().transpose(0, 1).numpy(),
            "loss": loss.detach().numpy(), "loss_mask": loss_mask.numpy(),
            "grads": {name: param.grad for name, param in model.named_parameters()}}


def _rank() -> dict[str, object]:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import torch.distributed as dist
    from megatron.core.models.mimo.partition import utils as partition

    from megatron_plugins.compat import model_build
    from megatron_plugins.ops.cp_attention import ContextParallelAttention
    from megatron_plugins.ops.fast_attention import FastAttention
    from megatron_plugins.parallel.layout import LANGUAGE, ModulePlacement, ParallelLayout
    from megatron_plugins.parallel.topology import build_topology

    model_build.ensure_global_memory_buffer()
    started = time.perf_counter()
    cp2 = build_topology(ParallelLayout((ModulePlacement(
        name=LANGUAGE, tp=1, pp=1, cp=2, dp=1, rank_offset=0),)))
    cp1 = build_topology(ParallelLayout((ModulePlacement(
        name=LANGUAGE, tp=1, pp=1, cp=1, dp=2, rank_offset=0),)))
    cp_group = cp2.module_pgs[LANGUAGE].cp
    results = {"cases": [], "rank": dist.get_rank()}
    for rope, packed in CASES:
        inputs = _inputs(rope, packed)
        model = _model(cp2, rope, 2, packed)
        reference = _model(cp1, rope, 1, packed)
        reference.load_state_dict(model.state_dict())
        attention = model.language_model.decoder.layers[0].self_attention.core_attention
        mine = _run(model, inputs)
        for grad in mine.pop("grads").values():
            dist.all_reduce(grad, group=cp_group)
        whole = _run(reference, inputs)
        grads = whole.pop("grads")
        mine["grad_diff"] = max(float((param.grad - grads[name]).abs().max())
                                for name, param in model.named_parameters())
        mine["grad_scale"] = max(float(g.abs().max()) for g in grads.values())
        mine["reference"] = whole
        mine["adapter"] = type(model.partition_adapter).__name__
        # The local path's default: the fast attention over the CP attention's exchange.
        mine["attention"] = (isinstance(attention, FastAttention)
                             and isinstance(attention.context_parallel, ContextParallelAttention)
                             and attention.context_parallel.fast)
        results["cases"].append(mine)
    results["te"] = partition._HAVE_TEX
    results["seconds"] = time.perf_counter() - started
    cp1.destroy()
    cp2.destroy()
    return results


@pytest.fixture(scope="module")
def cp2_ranks() -> list[dict[str, object]]:
    """Every case on 2 gloo ranks, in one launch (CI time)."""
    started = time.perf_counter()
    ranks = run_in_processes(_rank, 2, timeout=300, simulated=True)
    print(f"2-rank launch: {time.perf_counter() - started:.1f} s wall, "
          f"{max(r['seconds'] for r in ranks):.1f} s in the ranks")
    return ranks


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{rope}-{'thd' if packed else 'sbhd'}" for rope, packed in CASES])
@pytest.mark.multirank
def test_cp2_language_model_equals_cp1(cp2_ranks, case):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_plugins.ops.cp_positions import local_positions

    rope, packed = CASES[case]
    inputs = _inputs(rope, packed)
    length = inputs["input_ids"].shape[1]
    params = None
    if packed:
        params = PackedSeqParams(qkv_format="thd", **{
            key: value for key, value in inputs["packing_kwargs"].items()})
    reference = cp2_ranks[0]["cases"][case]["reference"]
    seen = []
    for rank, result in enumerate(cp2_ranks):
        mine = result["cases"][case]
        assert mine["attention"]
        assert mine["adapter"] == ("TorchThdPartitionAdapter" if not result["te"]
                                   else "PartitionAdapter")
        positions = local_positions(length, 2, rank, params).numpy()
        seen += positions.tolist()
        assert mine["logits"].shape[1] == length // 2
        np.testing.assert_allclose(mine["logits"], reference["logits"][:, positions],
                                   rtol=0, atol=1e-5)
        np.testing.assert_allclose(mine["loss"], reference["loss"][:, positions],
                                   rtol=0, atol=1e-5)
        np.testing.assert_array_equal(mine["loss_mask"], reference["loss_mask"][:, positions])
        # Gradients summed over CP: every rank holds the cp=1 gradient.
        assert mine["grad_diff"] < 1e-5 * max(1.0, mine["grad_scale"]), mine["grad_diff"]
    assert sorted(seen) == list(range(length))


@pytest.mark.parametrize("flags, message", [
    (dict(hybrid_layer_pattern="*-"), r"--hybrid-layer-pattern \*- with language context"),
    (dict(mtp_num_layers=1), r"--mtp-num-layers 1 with language context"),
    (dict(attention_dropout=0.1), r"--attention-dropout 0.1: .* pass --attention-dropout 0"),
], ids=["hybrid", "mtp", "dropout"])
def test_what_cp_does_not_cover_is_refused_in_one_line(flags, message):
    from megatron_plugins.model.language import LanguageModelError, language_config_from_args

    args = SimpleNamespace(**{"context_parallel_size": 2, "transformer_impl": "local",
                              "attention_dropout": 0.0, **flags})
    with pytest.raises(LanguageModelError, match=message) as error:
        language_config_from_args(args)
    assert "\n" not in str(error.value)


def test_attention_dropout_stays_with_transformer_engine_or_cp1():
    from megatron_plugins.model.language import language_config_from_args

    for cp, impl in ((2, "transformer_engine"), (1, "local")):
        args = _args("rope", 1, packed=False)
        args.context_parallel_size, args.transformer_impl, args.attention_dropout = cp, impl, 0.1
        assert language_config_from_args(args).transformer.attention_dropout == 0.1
