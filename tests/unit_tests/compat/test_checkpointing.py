"""Checkpoint bridges (Gaps 5, 6, 10): canaries that the stock wheel still has each gap, and the
bridges' tests."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from megatron_plugins.compat.checkpointing import (
    install_checkpoint_bridges,
    plain_values,
    put_plain_values,
)


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
