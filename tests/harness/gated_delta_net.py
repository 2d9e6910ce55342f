"""One tiny Gated DeltaNet layer, built by megatron-core and by transformers with the same
weights, for the tests of the reference kernels and of the bridge that binds them (Gap 30)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, CONV = 32, 2, 4, 16, 8, 4
EPS = 1e-6
SECTIONS = {"query": KEY_HEADS * KEY_DIM, "key": KEY_HEADS * KEY_DIM,
            "value": VALUE_HEADS * VALUE_DIM, "z": VALUE_HEADS * VALUE_DIM,
            "beta": VALUE_HEADS, "alpha": VALUE_HEADS}
"""megatron's in_proj output, section by section (each split evenly over TP ranks)."""
CONV_SECTIONS = [SECTIONS["query"], SECTIONS["key"], SECTIONS["value"]]


def megatron_layer(pg_collection: ProcessGroupCollection) -> torch.nn.Module:
    """megatron-core's ``GatedDeltaNet`` on the local spec's pieces, TP from ``pg_collection``;
    parameters uninitialised (tests load them). Needs the kernels bound (Gap 30)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, normalization="RMSNorm",
        layernorm_epsilon=EPS, activation_func=F.silu, add_bias_linear=False,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
        linear_conv_kernel_dim=CONV, linear_key_head_dim=KEY_DIM,
        linear_value_head_dim=VALUE_DIM, linear_num_key_heads=KEY_HEADS,
        linear_num_value_heads=VALUE_HEADS, tensor_model_parallel_size=pg_collection.tp.size(),
        use_cpu_initialization=True, perform_initialization=False)
    submodules = GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=ModuleSpec(module=WrappedTorchNorm),
        out_proj=RowParallelLinear)
    return GatedDeltaNet(config, submodules, layer_number=1, pg_collection=pg_collection)


def transformers_layer(seed: int = 0) -> torch.nn.Module:
    """transformers' ``Qwen3_5GatedDeltaNet`` of the same sizes, every weight random (the gated
    norm's too, so a weight read as 1-centred would show)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=HIDDEN, hidden_act="silu", rms_norm_eps=EPS, num_hidden_layers=1,
        layer_types=["linear_attention"], linear_conv_kernel_dim=CONV,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM,
        linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.3 if name.endswith("weight") else 1.0
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
        layer.A_log.copy_(torch.rand(VALUE_HEADS, generator=generator).add(0.5).log())
        layer.norm.weight.add_(1.0)
    return layer


@contextlib.contextmanager
def float64_throughout() -> Iterator[None]:
    """Within this, a float64 tensor's ``.float()`` and ``.to(torch.float32)`` stay float64, so
    a float64 transformers model computes in float64 end to end, the exact reference for a
    float32 path: its Gated DeltaNet casts to float32 inside (the gated norm, the decay, the
    torch rule's inputs), which would round the reference to float32 there (1-2e-6 of the
    logits' largest magnitude on the tiny Qwen3.5-VL). Other tensors cast as asked."""
    to, to_float = torch.Tensor.to, torch.Tensor.float

    def keep_float64(tensor, *args, **kwargs):
        if tensor.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "to", keep_float64)
        patch.setattr(torch.Tensor, "float",
                      lambda t, *a, **k: t if t.dtype == torch.float64 else to_float(t, *a, **k))
        yield


def float64_forward(layer: torch.nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
    """transformers' ``layer`` on ``inputs`` in float64 end to end (:func:`float64_throughout`);
    ``layer`` itself is left as it was."""
    with float64_throughout(), torch.no_grad():
        return copy.deepcopy(layer).double()(*(t.double() for t in inputs))


def _shard(weight: torch.Tensor, sections: list[int], rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``weight``: its share of each section, sections in order."""
    return torch.cat([part.chunk(size)[rank] for part in weight.split(sections)])


def load_transformers_weights(layer: torch.nn.Module, reference: torch.nn.Module, rank: int = 0,
                              size: int = 1) -> None:
    """Copy ``reference``'s weights into megatron's ``layer``, as TP rank ``rank`` of ``size``
    holds them: in_proj = [q; k; v; z; b; a] and the conv channels [q; k; v], each section split
    over the ranks; A_log and dt_bias by value head; out_proj by input column."""
    in_proj = torch.cat([reference.in_proj_qkv.weight, reference.in_proj_z.weight,
                         reference.in_proj_b.weight, reference.in_proj_a.weight])
    with torch.no_grad():
        layer.in_proj.weight.copy_(_shard(in_proj, list(SECTIONS.values()), rank, size))
        layer.conv1d.weight.copy_(_shard(reference.conv1d.weight, CONV_SECTIONS, rank, size))
        layer.A_log.copy_(reference.A_log.chunk(size)[rank])
        layer.dt_bias.copy_(reference.dt_bias.chunk(size)[rank])
        layer.out_norm.weight.copy_(reference.norm.weight)
        layer.out_proj.weight.copy_(reference.out_proj.weight.chunk(size, dim=1)[rank])


def undo_bridge_after_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Have ``monkeypatch`` restore what the Gap 30 bridge changes (megatron's kernel names and
    ``HAVE_FLA``, the recorded gaps), so that a test may apply it and the next still sees stock."""
    from megatron.core.ssm import gated_delta_net as package
    from megatron.core.ssm.gated_delta_net import common, gdn

    from megatron_plugins import compat

    for module in (package, common, gdn):
        for name in ("HAVE_FLA", "causal_conv1d", "l2norm", "chunk_gated_delta_rule"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(compat, "_recorded", set())
