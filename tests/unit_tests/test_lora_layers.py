"""LoRA adapters in Megatron's tensor-parallel linears equal the same adapters on one rank.

A column-parallel ``linear_fc1`` then a row-parallel ``linear_fc2`` (an MLP's shape), adapted,
frozen base weights, adapters with nonzero ``B``: at TP 2, with and without sequence parallelism,
the output and the input's and every adapter's gradient are the one-rank layers' (the TP shard
of each, the whole of a replicated adapter on every rank). Two gloo ranks, float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.harness.multiprocess import run_in_processes

IN, HIDDEN, OUT, SEQ, BATCH, RANK = 8, 12, 6, 4, 3, 2


class _Pair(torch.nn.Module):
    """``fc2(gelu(fc1(x)))`` of Megatron's local linears on ``group``."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.transformer_config import TransformerConfig

        super().__init__()
        config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=2,
                                   tensor_model_parallel_size=group.size(),
                                   sequence_parallel=sequence_parallel and group.size() > 1,
                                   use_cpu_initialization=True, params_dtype=torch.float64,
                                   gradient_accumulation_fusion=False)
        init = torch.nn.init.zeros_
        self.linear_fc1 = ColumnParallelLinear(IN, HIDDEN, config=config, init_method=init,
                                               bias=False, gather_output=False, tp_group=group)
        self.linear_fc2 = RowParallelLinear(HIDDEN, OUT, config=config, init_method=init,
                                            bias=False, input_is_parallel=True,
                                            skip_bias_add=False, tp_group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(torch.nn.functional.gelu(hidden))
        return out


def _whole(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"fc1": (HIDDEN, IN), "fc2": (OUT, HIDDEN), "b1": (HIDDEN, RANK),
              "b2": (OUT, RANK), "x": (SEQ, BATCH, IN), "grad": (SEQ, BATCH, OUT)}
    return {k: torch.randn(*s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}


def _adapted(group: dist.ProcessGroup, sequence_parallel: bool) -> _Pair:
    """The pair on ``group``, its weights and adapters' ``B`` this rank's slices of
    :func:`_whole`'s; ``A`` as LoRA draws it."""
    from megatron_plugins.peft.flags import LoraSpec
    from megatron_plugins.peft.layers import adapt

    pair = _Pair(group, sequence_parallel)
    assert adapt(pair, LoraSpec("language", RANK, 4.0, 0.0, ("linear_fc1", "linear_fc2")),
                 seed=7) == 2
    whole, tp, rank = _whole(0), group.size(), group.rank()
    with torch.no_grad():
        pair.linear_fc1.weight.copy_(whole["fc1"].chunk(tp, 0)[rank])
        pair.linear_fc1.lora_b.copy_(whole["b1"].chunk(tp, 0)[rank])
        pair.linear_fc2.weight.copy_(whole["fc2"].chunk(tp, 1)[rank])
        pair.linear_fc2.lora_b.copy_(whole["b2"])
    return pair


def _run(pair: _Pair, x: torch.Tensor, grad: torch.Tensor) -> dict[str, np.ndarray]:
    x = x.clone().requires_grad_(True)
    out = pair(x)
    out.backward(grad)
    found = {"out": out, "x_grad": x.grad}
    for name, p in pair.named_parameters():
        found[name] = p.detach()
        found[f"{name}.grad"] = p.grad
    return {k: v.detach().numpy().copy() if v is not None else None for k, v in found.items()}


def _rank(sequence_parallel: bool) -> dict[str, dict[str, np.ndarray]]:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    # Megatron's sequence-parallel gathers allocate on torch.cuda.current_device() in backward,
    # where the simulation's device mode is not active: name the CPU there directly.
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron_plugins.compat import model_build

    model_build.ensure_global_memory_buffer()
    world, rank = dist.group.WORLD, dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    whole = _whole(0)
    rows = whole["x"].shape[0] // 2
    shard = slice(rank * rows, (rank + 1) * rows) if sequence_parallel else slice(None)
    return {"one": _run(_adapted(alone, sequence_parallel), whole["x"], whole["grad"]),
            "tp2": _run(_adapted(world, sequence_parallel), whole["x"][shard],
                        whole["grad"][shard])}


@pytest.mark.multirank
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_adapters_at_tp2_equal_one_rank(sequence_parallel):
    ranks = run_in_processes(_rank, 2, args=(sequence_parallel,), timeout=240, simulated=True)
    rows = SEQ // 2
    for rank, result in enumerate(ranks):
        one, tp2 = result["one"], result["tp2"]
        part = slice(rank * rows, (rank + 1) * rows) if sequence_parallel else slice(None)
        expected = {
            "out": one["out"][part], "x_grad": one["x_grad"][part],
            # column parallel: A whole everywhere, B this rank's output rows
            "linear_fc1.lora_a.grad": one["linear_fc1.lora_a.grad"],
            "linear_fc1.lora_b.grad": np.split(one["linear_fc1.lora_b.grad"], 2)[rank],
            # row parallel: A this rank's input columns, B whole everywhere
            "linear_fc2.lora_a.grad": np.split(one["linear_fc2.lora_a.grad"], 2, axis=1)[rank],
            "linear_fc2.lora_b.grad": one["linear_fc2.lora_b.grad"],
            "linear_fc2.lora_a": np.split(one["linear_fc2.lora_a"], 2, axis=1)[rank],
            "linear_fc1.lora_a": one["linear_fc1.lora_a"],
        }
        for name, want in expected.items():
            np.testing.assert_allclose(tp2[name], want, rtol=1e-10, atol=1e-12,
                                       err_msg=f"rank {rank}: {name}")
        assert tp2["linear_fc1.weight.grad"] is None and tp2["linear_fc2.weight.grad"] is None
        assert np.abs(one["linear_fc1.lora_a.grad"]).max() > 0


def test_adapters_start_at_zero_and_draw_a_from_the_layer_name_alone():
    """``B`` starts at zero (an adapted model starts as its base); ``A`` depends on the seed and
    the layer's global name, not on the random streams (drawing it moves none)."""
    from megatron_plugins.peft.layers import _initial_a

    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = _initial_a(4, 16, 1234, "language/decoder.layers.3.mlp.linear_fc1.weight")
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, _initial_a(4, 16, 1234, "language/decoder.layers.3.mlp.linear_fc1.weight"))
    assert not torch.equal(a, _initial_a(4, 16, 1234, "language/decoder.layers.2.mlp.linear_fc1.weight"))
    assert a.abs().max() <= 16 ** -0.5
