"""The wheel bridges close real gaps, and importing the plugin set changes nothing.

Each gap test asserts the gap still exists in the installed megatron-core: when a release closes
it, the test fails and the bridge is removed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import megatron.core.datasets
import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins import megatron_compat
from tests.multiprocess import REPO_ROOT

SNAPSHOT = """
import importlib, pkgutil, sys, torch, torch.cuda, torch.distributed
import megatron.core.datasets.utils, megatron.core.parallel_state, megatron.training.initialize
import megatron.training.training, megatron.core.tensor_parallel.random
watched = [torch, torch.cuda, torch.cuda.random, torch.distributed,
           torch.distributed.distributed_c10d, torch.Tensor] + [
    module for name, module in sorted(sys.modules.items()) if name.startswith("megatron.")]
def snapshot():
    return {(getattr(w, "__name__", str(w)), name): id(value)
            for w in watched for name, value in list(vars(w).items())}
before = snapshot()
import megatron_plugins
names = sorted(m.name for m in pkgutil.walk_packages(megatron_plugins.__path__, "megatron_plugins."))
for name in names:
    importlib.import_module(name)
changed = sorted(key for key, value in snapshot().items() if before.get(key, value) != value)
print(len(names), changed)
"""


def test_importing_every_plugin_module_changes_nothing_in_torch_or_megatron():
    result = subprocess.run([sys.executable, "-c", SNAPSHOT], cwd=REPO_ROOT, text=True,
                            capture_output=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    count, changed = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 15  # every module of the package was imported
    assert changed == "[]"


def test_gap1_wheel_ships_prebuilt_helpers_but_no_makefile():
    datasets = Path(megatron.core.datasets.__file__).parent
    assert not (datasets / "Makefile").exists()
    assert megatron_compat.prebuilt_dataset_helpers_available()


def test_gap2_disjoint_grids_leave_the_global_memory_buffer_unset(monkeypatch):
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    assert not parallel_state.model_parallel_is_initialized()
    megatron_compat.ensure_global_memory_buffer()
    buffer = parallel_state.get_global_memory_buffer()
    megatron_compat.ensure_global_memory_buffer()
    assert parallel_state.get_global_memory_buffer() is buffer


def test_gap3_vit_has_no_explicit_tp_group_and_the_bridge_binds_one():
    assert "tp_group" not in inspect.getsource(CLIPViTModel)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    outer, inner = MegatronModule(config), MegatronModule(config)
    outer.inner = inner
    inner.tp_group = own = object()
    group = object()
    megatron_compat.bind_tp_group(outer, group)
    assert outer.tp_group is group and inner.tp_group is own


def test_gap4_stock_moe_spec_consults_the_global_pipeline_rank():
    from megatron.training.models import gpt

    assert "pp_rank" not in inspect.getsource(gpt.default_layer_spec)


def test_gap5_mimo_optimizer_keeps_plain_state_in_rank_zero_common_state():
    from megatron.core.models.mimo import optimizer as mimo_optimizer

    assert "sub_sd.get('optimizer')" in inspect.getsource(mimo_optimizer._extract_param_groups)
    assert "common_step" not in inspect.getsource(mimo_optimizer.MimoOptimizer)


def test_gap5_bridge_round_trips_plain_optimizer_values():
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded = ShardedObject("key", {"x": 1}, (1,), (0,))
    state = {"state": {"common_step": 7, "0": {"exp_avg": sharded}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    values = megatron_compat.plain_values(state)
    assert values == {("state", "common_step"): 7,
                      ("param_groups",): [{"lr": 0.1, "params": [0, 1]}]}
    template = {"state": {"0": {"exp_avg": sharded}}}
    megatron_compat.put_plain_values(template, values, "language")
    assert template["state"]["common_step"] == 7 and template["param_groups"][0]["lr"] == 0.1


def test_gap6_distributed_optimizer_state_dict_asserts_one_step():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert "assert len(steps) == 1" in inspect.getsource(DistributedOptimizer.state_dict)


def test_gap7_stock_help_breaks_argparse_and_the_bridge_escapes_only_that_string():
    import argparse

    import pytest
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(prog="p", allow_abbrev=False))
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
    untouched = [action.help for action in parser._actions]
    assert megatron_compat.escape_unformattable_help(parser) == [
        "--moe-paged-stash-buffer-size-factor-cuda"]
    help_text = parser.format_help()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in help_text
    changed = [action.option_strings for action, before in zip(parser._actions, untouched)
               if action.help != before]
    assert changed == [["--moe-paged-stash-buffer-size-factor-cuda"]]
    assert megatron_compat.escape_unformattable_help(parser) == []  # idempotent

def _source_digest(function: object) -> str:
    import hashlib

    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def test_gap8_mimo_optimizer_issues_separate_world_reductions() -> None:
    """Gap 8: the wheel's MimoOptimizer.step is what the folded step replicates, and the
    step_with_ready_grads it trusts to succeed are the 0.19.2 ones (a new release fails here)."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer

    step = inspect.getsource(MimoOptimizer.step)
    assert step.count("torch.distributed.all_reduce(") == 2, "found-inf and success reductions"
    assert "torch.distributed.all_reduce(norm_sq" in inspect.getsource(MimoOptimizer.get_grad_norm)
    assert _source_digest(MimoOptimizer.step) == "b94c7151c14f89f1"
    assert _source_digest(MimoOptimizer.get_grad_norm) == "e9d577bfcae5757f"
    digests = {"MixedPrecisionOptimizer": "34fc101b433f1515", "FP32Optimizer": "90ac3825f5932ab0",
               "DistributedOptimizer": "2350cce9dd8822dd"}
    for path in megatron_compat._SUCCEEDING_STEPS:
        cls = path.partition(":")[2].split(".")[0]
        assert _source_digest(megatron_compat._resolve(path)) == digests[cls], path


def test_gap8_always_succeeds_follows_chains() -> None:
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    fp32 = FP32Optimizer.__new__(FP32Optimizer)
    chain = ChainedOptimizer.__new__(ChainedOptimizer)
    chain.chained_optimizers = [fp32, fp32]
    assert megatron_compat.always_succeeds(chain)

    class MayFail(FP32Optimizer):
        def step_with_ready_grads(self) -> bool:
            return False

    chain.chained_optimizers = [fp32, MayFail.__new__(MayFail)]
    assert not megatron_compat.always_succeeds(chain)


def test_gap9_bridge_exchanges_shapes_on_every_transfer() -> None:
    """Gap 9: every bridge transfer asks for a shape handshake, and the multi-module schedule
    insists on variable_seq_lengths (so no static tensor_shape reaches the bridge)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    for name in ("send_forward", "recv_forward", "send_backward", "recv_backward",
                 "send_forward_recv_backward", "send_backward_recv_forward"):
        assert "self._communicate_shapes(" in inspect.getsource(getattr(BridgeCommunicator, name))
    assert _source_digest(BridgeCommunicator._communicate_shapes) == "522553b2bc0c597e"
    assert "config.variable_seq_lengths=True required for multi-module pipelines" in (
        inspect.getsource(schedules.forward_backward_pipelining_without_interleaving))


def test_gap13_stage_links_exchange_shapes_on_every_transfer() -> None:
    """Gap 13: with variable_seq_lengths (which the multi-module schedule insists on, Gap 9)
    every stage-to-stage transfer asks for a shape handshake."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    communicate = inspect.getsource(P2PCommunicator._communicate)
    assert "if config.variable_seq_lengths or config.mtp_standalone:" in communicate
    assert "self._communicate_shapes(" in communicate
    assert _source_digest(P2PCommunicator._communicate_shapes) == "64129c790b8b6e3d"


def test_gap13_a_stage_link_exchanges_each_direction_once_and_refuses_new_shapes() -> None:
    exchanged = []

    def stock(send_next, send_prev, recv_prev, recv_next):
        exchanged.append((send_next is not None, send_prev is not None, recv_prev, recv_next))
        return ([4, 2, 8] if recv_prev else [0, 0, 0]), ([4, 2, 8] if recv_next else [0, 0, 0])

    p2p = SimpleNamespace(_communicate_shapes=stock)
    megatron_compat._static_stage_shapes(p2p, "language")
    activation = torch.zeros(4, 2, 8)
    for _ in range(3):  # a middle stage's steady state: send forward, receive backward, ...
        assert p2p._communicate_shapes(activation, None, False, True) == ([0, 0, 0], [4, 2, 8])
        assert p2p._communicate_shapes(None, activation, True, False) == ([4, 2, 8], [0, 0, 0])
    assert exchanged == [(True, False, False, True), (False, True, True, False)] + [
        (False, False, False, False)] * 4
    with pytest.raises(megatron_compat.MegatronCompatError, match="changed shape"):
        p2p._communicate_shapes(torch.zeros(4, 3, 8), None, False, False)


def test_gap4_bridge_leaves_hybrid_configs_to_their_own_builder():
    from megatron.training.models.hybrid import HybridModelConfig

    config = HybridModelConfig(transformer=_moe_config(ep_size=1), hybrid_layer_pattern="*E")
    assert not hasattr(config, "transformer_layer_spec")
    assert megatron_compat.with_explicit_moe_spec(config, pp_rank=0) is config


class _Group:
    """A process group stand-in: the expert modules only ask it for rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _moe_config(ep_size: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=1,
        num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=ep_size,
        use_cpu_initialization=True, add_bias_linear=True, gradient_accumulation_fusion=False)


@pytest.fixture
def one_rank_world():
    """A one-rank gloo world: tensor-parallel mappings ignore their group without one."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _experts(ep_rank: int, ep_size: int, seed: int = 1234):
    """The local experts of one expert-parallel rank of a 4-expert layer, built after ``seed``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(seed)
    groups = SimpleNamespace(ep=_Group(ep_rank, ep_size), expt_tp=_Group(0, 1),
                             expt_dp=_Group(0, 1))
    experts = SequentialMLP(4 // ep_size, _moe_config(ep_size),
                            MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                          linear_fc2=RowParallelLinear),
                            pg_collection=groups)
    return experts


def _expert_weights(experts) -> list[torch.Tensor]:
    return [torch.cat([p.detach().flatten() for p in expert.parameters()])
            for expert in experts.local_experts]


def _expert_forward(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Output of local expert 0 for fixed tokens and routing probabilities, and its input grad."""
    tokens = torch.linspace(-1, 1, 5 * 8).reshape(5, 8).requires_grad_()
    probs = torch.linspace(0.1, 0.9, 5)
    output, bias = experts.local_experts[0](tokens, probs)
    assert bias is None
    output.sum().backward()
    return output.detach(), tokens.grad


def test_gap4a_expert_bias_add_on_one_expert_rank_hits_the_identity_reduce_view(one_rank_world):
    experts = _experts(ep_rank=0, ep_size=1)
    assert not experts.local_experts[0].linear_fc2.explicit_expert_comm
    with pytest.raises(RuntimeError, match="_ReduceFromModelParallelRegion is a view"):
        _expert_forward(experts)


def test_gap4a_bridge_skips_only_the_identity_reduce(one_rank_world):
    experts = _experts(ep_rank=0, ep_size=1)
    megatron_compat.direct_single_rank_expert_output(experts)
    output, grad = _expert_forward(experts)
    expert = experts.local_experts[0]
    tokens = torch.linspace(-1, 1, 5 * 8).reshape(5, 8).requires_grad_()
    probs = torch.linspace(0.1, 0.9, 5)
    hidden = torch.nn.functional.gelu(tokens @ expert.linear_fc1.weight.T + expert.linear_fc1.bias)
    expected = (hidden @ expert.linear_fc2.weight.T + expert.linear_fc2.bias) * probs[:, None]
    expected.sum().backward()
    torch.testing.assert_close(output, expected.detach())
    torch.testing.assert_close(grad, tokens.grad)
    # Expert layers with a real reduce (EP > 1) are left as stock built them.
    assert _experts(ep_rank=0, ep_size=2).local_experts[0].linear_fc2.explicit_expert_comm


def test_gap4b_stock_cpu_init_copies_the_experts_of_every_expert_rank():
    first, second = _expert_weights(_experts(0, 2)), _expert_weights(_experts(1, 2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gap4b_bridge_gives_every_expert_its_own_deterministic_weights():
    from megatron.core.transformer.moe import experts as experts_module

    stock_init, stock_mlp = experts_module.SequentialMLP.__init__, experts_module.MLP
    with megatron_compat.distinct_cpu_init_experts():
        ep0 = _experts(0, 2)
        after_ep0 = torch.default_generator.get_state()
        ep1 = _experts(1, 2)
        after_ep1 = torch.default_generator.get_state()
        again = _expert_weights(_experts(1, 2))
        one_rank = _expert_weights(_experts(0, 1))
        other_seed = _expert_weights(_experts(1, 2, seed=4321))
    assert experts_module.SequentialMLP.__init__ is stock_init and experts_module.MLP is stock_mlp
    weights = _expert_weights(ep0) + _expert_weights(ep1)
    assert all(not torch.equal(weights[i], weights[j]) for i in range(4) for j in range(i))
    # Deterministic for a seed, distinct for another, independent of the EP size.
    assert all(torch.equal(a, b) for a, b in zip(_expert_weights(ep1), again))
    assert not any(torch.equal(a, b) for a, b in zip(again, other_seed))
    assert all(torch.equal(a, b) for a, b in zip(weights, one_rank))
    # Every expert rank leaves the default generator in the same state (replicated weights next).
    assert torch.equal(after_ep0, after_ep1)


def test_gap4c_stock_hybrid_stack_is_transformer_engine_only():
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.models.hybrid.hybrid_block import HybridStack
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    attention = hybrid_stack_spec.submodules.attention_layer.submodules.self_attention
    assert attention.submodules.linear_qkv is TELayerNormColumnParallelLinear
    assert "self.final_norm = TENorm(" in inspect.getsource(HybridStack.__init__)


def _spec_classes(spec) -> set[type]:
    """Every class a spec tree names (modules, submodules, partial targets)."""
    if isinstance(spec, functools.partial):
        return {spec.func.__self__ if inspect.ismethod(spec.func) else spec.func} | _spec_classes(
            spec.keywords.get("submodules"))
    if isinstance(spec, type):
        return {spec}
    if hasattr(spec, "module"):
        return _spec_classes(spec.module) | _spec_classes(getattr(spec, "submodules", None))
    if dataclasses.is_dataclass(spec):
        fields = dataclasses.fields(spec)
        return set().union(*(_spec_classes(getattr(spec, field.name)) for field in fields))
    return set()


def test_gap4c_bridge_builds_attention_mlp_and_moe_layers_from_local_modules():
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.training.models.hybrid import HybridModelConfig

    transformer = _moe_config(ep_size=1)
    transformer.transformer_impl = "local"
    config = HybridModelConfig(transformer=transformer, hybrid_layer_pattern="*-E")
    resolved = megatron_compat.with_local_hybrid_spec(config)
    assert config.hybrid_stack_spec is None and resolved.hybrid_stack_spec is not None
    layers = resolved.hybrid_stack_spec.submodules
    used = set().union(*(_spec_classes(getattr(layers, name))
                         for name in ("attention_layer", "mlp_layer", "moe_layer")))
    assert SequentialMLP in used
    assert not [c for c in used if c.__module__.endswith("transformer_engine")]
    source = inspect.getsource(resolved.hybrid_stack_spec.module.__init__)
    assert "TENorm" not in source
    # Transformer Engine runs and explicit specs keep the stock stack.
    transformer.transformer_impl = "transformer_engine"
    assert megatron_compat.with_local_hybrid_spec(config) is config


def test_gap10_stock_names_dataloader_state_by_dp_rank_only():
    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing)
    assert "basename=f'train_dataloader_dprank{dp_rank:03d}.pt'" in source
    assert "maybe_save_dataloader_state(" in inspect.getsource(checkpointing.save_checkpoint)


def test_gap10_bridge_lets_a_module_stream_write_its_own_state(tmp_path):
    from megatron.training import checkpointing

    megatron_compat.install_checkpoint_bridges()
    written = []
    stream = SimpleNamespace(iterable=SimpleNamespace(save_data_state=written.append))
    checkpointing.maybe_save_dataloader_state(stream, 7, str(tmp_path), tp_group=None)
    assert written == [checkpointing.get_checkpoint_name(str(tmp_path), 7, return_base_dir=True)]
    # Without a save path nothing is saved, as in stock; other iterators get stock's function.
    checkpointing.maybe_save_dataloader_state(stream, 8, None)
    checkpointing.maybe_save_dataloader_state(SimpleNamespace(iterable=[]), 8, None)
    assert len(written) == 1


def test_gap11_stock_rerun_check_is_a_world_all_reduce_after_the_result_checks():
    """Gap 11: the initial run's check all-reduces one flag over the world (no group), and the
    gradient result checks run before the DP reduce, so before the MiMo token count."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.rerun_state_machine import RerunStateMachine

    stock = megatron_compat._stock_reduce_any or RerunStateMachine._reduce_any
    assert "torch.distributed.all_reduce(val_tensor)\n" in inspect.getsource(stock)
    assert _source_digest(stock) == "9fc4efee07ae520d"
    assert "will_rerun = self._reduce_any(self.rerun_requested)" in inspect.getsource(
        RerunStateMachine.should_run_forward_backward)
    start = inspect.getsource(_ParamAndGradBucketGroup.start_grad_sync)
    assert start.index("self.check_grads(") < start.index("reduce_op = ")


@pytest.fixture
def validating_machine(monkeypatch):
    """A rerun state machine in stock's default mode, in its initial run, with the bridge on and
    stock's reduction recorded instead of issued."""
    from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

    megatron_compat.install_step_bridges()
    stock_calls = []
    monkeypatch.setattr(megatron_compat, "_stock_reduce_any",
                        lambda machine, value: stock_calls.append(value) or False)
    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.state = RerunState.INITIAL_RUN
    monkeypatch.setattr("megatron.core.rerun_state_machine.get_rerun_state_machine",
                        lambda: machine)
    return machine, stock_calls


def test_gap11_settled_vote_answers_the_check_without_a_reduction(validating_machine):
    from megatron.core.rerun_state_machine import RerunState

    machine, stock_calls = validating_machine
    megatron_compat.settle_rerun_vote(megatron_compat.rerun_vote(), world_sum=1)
    assert machine._reduce_any(machine.rerun_requested) is True  # another rank asked
    assert stock_calls == []
    megatron_compat.settle_rerun_vote(megatron_compat.rerun_vote(), world_sum=0)
    assert not machine.should_run_forward_backward(None) and stock_calls == []
    assert machine.state == RerunState.NOT_RUNNING_YET
    # Nothing settled for this step (a split step, or no finalization): stock's reduction.
    machine.state = RerunState.INITIAL_RUN
    assert not machine.should_run_forward_backward(None) and stock_calls == [False]


def test_gap11_a_flag_raised_after_the_count_is_refused(validating_machine):
    machine, _ = validating_machine
    megatron_compat.settle_rerun_vote(megatron_compat.rerun_vote(), world_sum=0)
    machine.rerun_requested = True
    with pytest.raises(megatron_compat.MegatronCompatError, match="Gap 11"):
        machine.should_run_forward_backward(None)


def test_gap12_bridge_broadcasts_after_every_transfer_in_its_grid_group():
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    calls = {name: inspect.getsource(getattr(BridgeCommunicator, name)).count("dist.broadcast(")
             for name in ("recv_forward", "recv_backward", "send_forward_recv_backward",
                          "send_backward_recv_forward")}
    assert all(count >= 4 for count in calls.values()), calls
    for name in calls:
        source = inspect.getsource(getattr(BridgeCommunicator, name))
        assert source.count("group=self.dest_grid_broadcast_pg") + source.count(
            "group=self.src_grid_broadcast_pg") == calls[name], name


def test_gap12_bridge_skips_only_broadcasts_in_one_member_groups(one_rank_world, monkeypatch):
    from megatron.core.pipeline_parallel import bridge_communicator

    monkeypatch.setattr(bridge_communicator, "dist", bridge_communicator.dist)
    issued = []
    monkeypatch.setattr(torch.distributed, "broadcast",
                        lambda tensor, src=None, group=None, async_op=False: issued.append(group))
    megatron_compat.skip_lone_broadcasts()
    lone = torch.distributed.new_group([0])
    bridge_communicator.dist.broadcast(torch.zeros(2), src=0, group=lone)
    assert issued == []
    bridge_communicator.dist.broadcast(torch.zeros(2), src=0, group=None)
    assert issued == [None]
    assert bridge_communicator.dist.all_reduce is torch.distributed.all_reduce


def _bf16_router() -> tuple[TransformerConfig, MegatronModule]:
    """A module with a router's fp32 expert bias (set before the wrap, as an import does), its
    token counter, and stock's own keep-fp32 method."""
    from megatron.core.transformer.moe.router import TopKRouter

    class Router(MegatronModule):
        _maintain_float32_expert_bias = TopKRouter._maintain_float32_expert_bias

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
                               params_dtype=torch.bfloat16)
    router = Router(config)
    router.register_buffer("expert_bias", torch.tensor([0.1234567, -0.7654321]))
    router.register_buffer("local_tokens_per_expert", torch.zeros(2), persistent=False)
    return config, router


def test_gap14_float16_module_rounds_a_router_bias_set_before_the_wrap():
    from megatron.core.transformer.module import Float16Module

    config, router = _bf16_router()
    exact = router.expert_bias.clone()
    Float16Module(config, router)
    router._maintain_float32_expert_bias()  # what the router's next forward does
    assert router.expert_bias.dtype == torch.float32
    assert not torch.equal(router.expert_bias, exact)


def test_gap14_bridge_puts_back_exactly_the_buffers_the_router_keeps_fp32():
    from megatron.core.transformer.module import Float16Module

    config, router = _bf16_router()
    exact = router.expert_bias.clone()
    with megatron_compat.exact_fp32_router_buffers(router):
        Float16Module(config, router)
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, exact)
    assert router.local_tokens_per_expert.dtype == torch.bfloat16  # stock keeps it in bf16
