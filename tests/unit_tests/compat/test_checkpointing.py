"""Checkpoint bridges (Gaps 5, 6, 10, 16): canaries that the stock wheel still has each gap, and the
bridges' tests."""

from __future__ import annotations

import inspect
import subprocess
import sys
from types import SimpleNamespace

from megatron_plugins.compat.checkpointing import (
    install_checkpoint_bridges,
    plain_values,
    put_plain_values,
)
from tests.multiprocess import REPO_ROOT


def test_gap5_canary_mimo_optimizer_keeps_plain_state_in_rank_zero_common_state():
    from megatron.core.models.mimo import optimizer as mimo_optimizer

    assert "sub_sd.get('optimizer')" in inspect.getsource(mimo_optimizer._extract_param_groups)
    assert "common_step" not in inspect.getsource(mimo_optimizer.MimoOptimizer)


def test_gap5_bridge_round_trips_plain_optimizer_values():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded = ShardedObject("key", {"x": 1}, (1,), (0,))
    state = {"state": {"common_step": 7, "0": {"exp_avg": sharded}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    values = plain_values(state)
    assert values == {("state", "common_step"): 7,
                      ("param_groups",): [{"lr": 0.1, "params": [0, 1]}]}
    template = {"state": {"0": {"exp_avg": sharded}}}
    put_plain_values(template, values, "language")
    assert template["state"]["common_step"] == 7 and template["param_groups"][0]["lr"] == 0.1


def test_gap6_distributed_optimizer_state_dict_asserts_one_step():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert "assert len(steps) == 1" in inspect.getsource(DistributedOptimizer.state_dict)


STOCK_DISTRIBUTED_OPTIMIZER_RESUME = """
import tempfile

from megatron_plugins.cpu_simulation import patches

patches.activate()
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                     world_size=1)
parallel_state.initialize_model_parallel()
config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def build(steps):
    torch.manual_seed(0)
    module = MegatronModule(config)
    module.first, module.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True), module)
    [optimizer] = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=0.1, use_distributed_optimizer=True), [ddp]).chained_optimizers
    for _ in range(steps):
        ddp.zero_grad_buffer()
        module.second(module.first(torch.ones(3, 4))).sum().backward()
        ddp.finish_grad_sync()
        optimizer.step()
    return optimizer, ddp.sharded_state_dict()


def loaded(folder, template_steps):
    optimizer, model = build(template_steps)
    state = dist_checkpointing.load(optimizer.sharded_state_dict(
        model, is_loading=True, metadata=METADATA), folder)
    return optimizer, state


def outcome(action):
    try:
        action()
    except (AssertionError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


folder = tempfile.mkdtemp()
saved, model = build(steps=2)
dist_checkpointing.save(saved.sharded_state_dict(model, metadata=METADATA), folder)
fresh, model = build(steps=0)
print("fresh template:", outcome(lambda: fresh.sharded_state_dict(model, is_loading=True,
                                                                   metadata=METADATA)))
optimizer, state = loaded(folder, template_steps=1)
print("load:", outcome(lambda: optimizer.load_state_dict(state)).split("\\n")[0])
optimizer, state = loaded(folder, template_steps=1)
with torch.no_grad():
    optimizer.load_state_dict(state)
steps = [param_state["step"] for param_state in optimizer.optimizer.state.values()]
saved_steps = {group["step"] for group in saved.state_dict()["optimizer"]["param_groups"]}
print("params", len(steps), "step tensors", len({id(step) for step in steps}),
      "step", float(steps[0]), "saved", saved_steps)
"""


def test_gap6_canary_stock_distributed_optimizer_resume_without_te_or_apex():
    """Gap 6, every part, on torch Adam in a one-rank world under the CPU simulation: a fresh
    optimizer cannot make a load template; the dp_reshardable param-state load copies into
    views of leaves outside no_grad; under no_grad every parameter gets one shared step tensor
    holding the template's step (1), not the saved one (2)."""
    result = subprocess.run([sys.executable, "-c", STOCK_DISTRIBUTED_OPTIMIZER_RESUME],
                            cwd=REPO_ROOT, text=True, capture_output=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = [line for line in result.stdout.splitlines()
                if line.startswith(("fresh template:", "load:", "params "))]
    assert reported == [
        "fresh template: AssertionError: ",
        "load: RuntimeError: a view of a leaf Variable that requires grad is being used in an "
        "in-place operation.",
        "params 4 step tensors 1 step 1.0 saved {2.0}"]


def test_gap10_canary_stock_names_dataloader_state_by_dp_rank_only():
    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing)
    assert "basename=f'train_dataloader_dprank{dp_rank:03d}.pt'" in source
    assert "maybe_save_dataloader_state(" in inspect.getsource(checkpointing.save_checkpoint)


def test_gap10_bridge_lets_a_module_stream_write_its_own_state(tmp_path):
    from megatron.training import checkpointing

    install_checkpoint_bridges()
    written = []
    stream = SimpleNamespace(iterable=SimpleNamespace(save_data_state=written.append))
    checkpointing.maybe_save_dataloader_state(stream, 7, str(tmp_path), tp_group=None)
    assert written == [checkpointing.get_checkpoint_name(str(tmp_path), 7, return_base_dir=True)]
    # Without a save path nothing is saved, as in stock; other iterators get stock's function.
    checkpointing.maybe_save_dataloader_state(stream, 8, None)
    checkpointing.maybe_save_dataloader_state(SimpleNamespace(iterable=[]), 8, None)
    assert len(written) == 1


def test_gap16_canary_stock_saves_one_rng_state_replicated_over_data_parallel_ranks():
    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing)
    assert ("if args.data_parallel_random_init and torch.distributed.is_initialized() and "
            "dp_world_size > 1:") in source
    assert "            (pp_size, tp_size),\n            (pp_rank, tp_rank),\n" \
           "            replica_id=dp_cp_rank," in source
    assert "rng_state = rng_state[0]" in inspect.getsource(checkpointing.load_checkpoint)


def test_gap16_bridge_shards_the_rng_state_over_data_parallel_replicas(monkeypatch):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.training import checkpointing

    install_checkpoint_bridges()
    monkeypatch.setattr(checkpointing, "get_args",
                        lambda: SimpleNamespace(data_parallel_random_init=False))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.zeros(4, dtype=torch.uint8))

    def group(size: int, rank: int) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: size, rank=lambda: rank)

    second = checkpointing.get_rng_state("torch_dist", None, None, dp_cp_group=group(2, 1),
                                         dp_group=group(2, 1), key_prefix="vision.")
    assert isinstance(second, ShardedObject) and second.key == "vision.rng_state"
    assert (second.global_shape, second.global_offset, second.replica_id) == ((1, 1, 2),
                                                                            (0, 0, 1), 0)
    assert len(second.data) == 1 and set(second.data[0]) >= {"torch_rng_state",
                                                             "rng_tracker_states"}
    alone = checkpointing.get_rng_state("torch_dist", None, None, dp_cp_group=group(1, 0),
                                        dp_group=group(1, 0), key_prefix="language.")
    assert (alone.global_shape, alone.global_offset) == ((1, 1), (0, 0))  # stock's, one replica
