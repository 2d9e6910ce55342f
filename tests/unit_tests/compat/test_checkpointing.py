"""Checkpoint bridges (Gaps 5, 6, 10, 16, 22, 26, 27, 35): canaries that the stock wheel still has
each gap, and the bridges' tests."""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest

from megatron_plugins.compat.checkpointing import (
    MODULE_RNG_STATES,
    bind_checkpoint_group,
    carry_module_rng,
    install_checkpoint_bridges,
    keep_save_results_in_process,
    plain_values,
    put_plain_values,
    restore_module_rng,
)
from tests.harness.multiprocess import run_in_processes, run_python


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
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


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


def loaded(folder, template_steps, metadata=METADATA):
    optimizer, model = build(template_steps)
    state = dist_checkpointing.load(optimizer.sharded_state_dict(
        model, is_loading=True, metadata=metadata), folder)
    return optimizer, state


def outcome(action):
    try:
        action()
    except (AssertionError, KeyError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "ok"


folder = tempfile.mkdtemp()
saved, saved_model = build(steps=2)
dist_checkpointing.save(saved.sharded_state_dict(saved_model, metadata=METADATA), folder)
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
folder = tempfile.mkdtemp()
dist_checkpointing.save(saved.sharded_state_dict(saved_model, metadata=FULLY_RESHARDABLE), folder)
optimizer, state = loaded(folder, template_steps=1, metadata=FULLY_RESHARDABLE)
with torch.no_grad():
    print("fully_reshardable load:", outcome(lambda: optimizer.load_state_dict(state)))
"""


@pytest.mark.multirank
def test_gap6_canary_stock_distributed_optimizer_resume_without_te_or_apex():
    """Gap 6, every part, on torch Adam in a one-rank world under the CPU simulation: a fresh
    optimizer cannot make a load template; the dp_reshardable param-state load copies into
    views of leaves outside no_grad; under no_grad every parameter gets one shared step tensor
    holding the template's step (1), not the saved one (2); a fully_reshardable param-state load
    brings no step for torch Adam's per-parameter one."""
    result = run_python(STOCK_DISTRIBUTED_OPTIMIZER_RESUME, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = [line for line in result.stdout.splitlines()
                if line.startswith(("fresh template:", "load:", "params ",
                                    "fully_reshardable load:"))]
    assert reported == [
        "fresh template: AssertionError: ",
        "load: RuntimeError: a view of a leaf Variable that requires grad is being used in an "
        "in-place operation.",
        "params 4 step tensors 1 step 1.0 saved {2.0}",
        "fully_reshardable load: KeyError: 'step'"]


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


def test_gap26_canary_stock_rng_state_holds_the_process_generators_only():
    from megatron.training import checkpointing

    source = inspect.getsource(checkpointing)  # the module's text: bridges replace its names
    saved = source.split("def get_rng_state(")[1].split("\ndef ")[0]
    assert "rng_state = {\n        'random_rng_state': random.getstate()," in saved
    assert saved.count("rng_state = {") == 1 and "module" not in saved.split("rng_state = {")[1]
    restored = source.split("def load_checkpoint(")[1].split("\ndef ")[0]
    assert "random.setstate(rng_state['random_rng_state'])" in restored
    assert "_load_base_checkpoint(" in restored


class _HostedRng:
    """What the bridge needs of a ``ModuleRng``: the live module and every module's streams."""

    live = "language"

    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"language": {"seed": 1}, "vision": {"seed": 2}}

    def load_state_dict(self, states: dict) -> None:
        self.loaded.append(states)


def test_gap26_bridge_carries_and_restores_the_hosted_encoders_streams(monkeypatch):
    import torch
    from megatron.training import checkpointing

    install_checkpoint_bridges(colocated=True)
    monkeypatch.setattr(checkpointing, "get_args", lambda: SimpleNamespace(
        data_parallel_random_init=False, finetune=False, no_load_rng=False))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.zeros(4, dtype=torch.uint8))
    one = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    hosted = _HostedRng()
    try:
        carry_module_rng(None, 0)
        plain = checkpointing.get_rng_state("torch_dist", one, one, dp_cp_group=one,
                                            dp_group=one, key_prefix="language.")
        assert MODULE_RNG_STATES not in plain.data[0]
        carry_module_rng(hosted, 0)
        saved = checkpointing.get_rng_state("torch_dist", one, one, dp_cp_group=one,
                                            dp_group=one, key_prefix="language.")
        assert saved.data[0][MODULE_RNG_STATES] == {"vision": {"seed": 2}}
        restore_module_rng({"rng_state": saved.data})
        assert hosted.loaded == [{"vision": {"seed": 2}}]
        monkeypatch.setattr(checkpointing, "get_args", lambda: SimpleNamespace(
            data_parallel_random_init=False, finetune=True, no_load_rng=False))
        restore_module_rng({"rng_state": saved.data})  # --finetune: stock restores no RNG
        assert len(hosted.loaded) == 1
    finally:
        carry_module_rng(None, 0)


def test_gap27_canary_stock_checkpoints_read_the_gtp_remat_group_and_fall_back_to_parallel_state(
        monkeypatch):
    """Stock save and load take the model's ``dp_cp_gtp_remat``; without it the checkpoint
    metadata asks parallel_state, uninitialized on disjoint grids."""
    from megatron.core import parallel_state
    from megatron.training import checkpointing, training

    for caller in (training.save_checkpoint_and_time, training.setup_model_and_optimizer):
        assert 'getattr(ckpt_pgc, "dp_cp_gtp_remat", None)' in inspect.getsource(caller)
    monkeypatch.setattr(parallel_state, "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", None)
    args = SimpleNamespace(use_distributed_optimizer=False, ckpt_format="torch_dist")
    with pytest.raises(AssertionError, match=r"data parallel group with CP .*not initialized"):
        checkpointing._build_sharded_state_dict_metadata(args, dp_cp_group=None)


def test_gap27_bridge_hands_stock_checkpoints_the_modules_dp_cp_group(monkeypatch):
    from megatron.core import parallel_state
    from megatron.training import checkpointing

    monkeypatch.setattr(parallel_state, "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT", None)
    module = SimpleNamespace(dp_cp=object())
    bind_checkpoint_group(module)
    args = SimpleNamespace(use_distributed_optimizer=False, ckpt_format="torch_dist")
    metadata = checkpointing._build_sharded_state_dict_metadata(
        args, dp_cp_group=getattr(module, "dp_cp_gtp_remat", None))  # as stock reads it
    assert metadata["dp_cp_group"] is module.dp_cp


def _groups(tp: int = 0, pp: int = 0, dp: int = 0, dp_cp: int = 0) -> SimpleNamespace:
    """A process-group collection whose groups only know their rank."""
    return SimpleNamespace(**{name: SimpleNamespace(rank=lambda rank=rank: rank)
                              for name, rank in (("tp", tp), ("pp", pp), ("dp", dp),
                                                 ("dp_cp", dp_cp))})


def test_gap22_canary_stock_mimo_replica_id_ignores_context_parallel_rank():
    """Data rank 0 at CP rank 1 is a main replica for stock, like CP rank 0."""
    from megatron.core.models.mimo import optimizer as mimo_optimizer

    stock = getattr(mimo_optimizer._get_replica_id, "__wrapped__", mimo_optimizer._get_replica_id)
    assert stock(_groups(dp_cp=1)) == (0, 0, 0)
    assert "replica_id = _get_replica_id(info.pg_collection)" in inspect.getsource(mimo_optimizer)


def test_gap22_bridge_replica_id_counts_data_and_context_parallel_ranks():
    from megatron.core.models.mimo import optimizer as mimo_optimizer

    install_checkpoint_bridges(context_parallel=True)
    assert mimo_optimizer._get_replica_id(_groups(dp_cp=1)) == (0, 0, 1)
    assert mimo_optimizer._get_replica_id(_groups(tp=1, pp=2, dp=1, dp_cp=3)) == (1, 2, 3)
    assert mimo_optimizer._get_replica_id(_groups(dp=1, dp_cp=0)) == (0, 0, 0)


# (bf16, --use-distributed-optimizer, distrib_optim_sharding_type) of the runs that put a MiMo
# optimizer ShardedObject in the checkpoint: every distributed-optimizer run, and bf16.
# fully_reshardable also checks Gap 6's step on torch Adam: its param-state load brings no step
# (distrib_optimizer.py:2390-2392, stock then fails with KeyError: 'step' at :1223).
CP2_CASES = {
    "bf16 dist-opt dp_reshardable": (True, True, "dp_reshardable"),
    "bf16 dist-opt fully_reshardable": (True, True, "fully_reshardable"),
    "bf16": (True, False, None),
    "fp32 dist-opt dp_reshardable": (False, True, "dp_reshardable"),
}


def _cp2_language(topology, bf16: bool, distributed: bool, steps: int):
    """The language model of a cp=2 grid as our builder wraps it, and its MiMo optimizer after
    ``steps`` Adam steps on fixed gradients."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.mimo.optimizer import get_mimo_optimizer
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugins.ops.cp_attention import ContextParallelAttention

    pgc = topology.module_pgs["language"]
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, context_parallel_size=2,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    model = GPTModel(config, spec, vocab_size=16, max_sequence_length=8, pg_collection=pgc)
    model = Float16Module(config, model) if bf16 else model
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed), model, pg_collection=pgc)
    mimo = SimpleNamespace(mimo_config=SimpleNamespace(module_to_grid_map=dict(topology.grids)),
                           language_model=ddp, modality_submodules={})
    optimizer = get_mimo_optimizer(mimo, OptimizerConfig(
        optimizer="adam", lr=0.1, bf16=bf16, use_distributed_optimizer=distributed))
    for step in range(steps):
        ddp.zero_grad_buffer()
        for param in ddp.parameters():
            param.main_grad.copy_(torch.linspace(-1, 1, param.numel()).view(param.shape) + step)
        ddp.finish_grad_sync()
        optimizer.module_infos["language"].optimizer.step()
    return ddp, optimizer


def _adam_state(optimizer) -> list:
    """Every Adam value of the language module: group settings, main params, moments and steps
    (the distributed optimizer's load adds a ``step`` to the group dicts, which Adam ignores)."""
    [inner] = optimizer.module_infos["language"].optimizer.chained_optimizers
    adam = inner.optimizer
    values = []
    for group in adam.param_groups:
        values.append({key: value for key, value in group.items() if key not in ("params", "step")})
        for param in group["params"]:
            values.append(param.detach().clone())
            values.extend(adam.state[param][key].detach().clone().float()
                          for key in ("exp_avg", "exp_avg_sq", "step"))
    return values


def _language_cp2_checkpoints(folder: str) -> dict:
    """On both ranks of a language-only cp=2 grid: stock's save validation, then with the bridges
    a save and a resume from a fresh optimizer, per case."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.utils import extract_sharded_base
    from megatron.core.dist_checkpointing.validation import (
        determine_global_metadata,
        validate_sharding_integrity,
    )

    from megatron_plugins.parallel.layout import ModulePlacement, ParallelLayout
    from megatron_plugins.parallel.topology import build_topology

    # Built directly: the layout flags refuse language cp > 1 until the bridge CP work lands.
    topology = build_topology(ParallelLayout((ModulePlacement(
        name="language", tp=1, pp=1, cp=2, dp=1, rank_offset=0),)))
    dp_cp = topology.module_pgs["language"].dp_cp

    def sharded(ddp, optimizer, sharding, is_loading=False):
        metadata = {"dp_cp_group": dp_cp, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
        if sharding:
            metadata["distrib_optim_sharding_type"] = sharding
        model = ddp.sharded_state_dict(metadata=metadata)
        return model, optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                   metadata=metadata)

    report = {}
    for case, (bf16, distributed, sharding) in CP2_CASES.items():
        ddp, optimizer = _cp2_language(topology, bf16, distributed, steps=2)
        _, state = sharded(ddp, optimizer, sharding)
        try:
            validate_sharding_integrity(determine_global_metadata(extract_sharded_base(state)[0])[1])
            report[case] = {"stock": "ok"}
        except CheckpointingException as error:
            report[case] = {"stock": str(error).splitlines()[0]}

    install_checkpoint_bridges(context_parallel=True)
    for index, (case, (bf16, distributed, sharding)) in enumerate(CP2_CASES.items()):
        ddp, optimizer = _cp2_language(topology, bf16, distributed, steps=2)
        saved = _adam_state(optimizer)
        model, state = sharded(ddp, optimizer, sharding)
        path = os.path.join(folder, str(index))
        os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model, "optimizer": state}, path)
        report[case]["saved"] = sorted(os.listdir(path)) != []
        ddp, template = _cp2_language(topology, bf16, distributed, steps=0)
        _, state = sharded(ddp, template, sharding, is_loading=True)
        template.load_state_dict(dist_checkpointing.load({"optimizer": state}, path)["optimizer"])
        resumed = _adam_state(template)
        report[case]["resumed"] = all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(saved, resumed, strict=True))
        report[case]["digest"] = [float(v.sum()) if isinstance(v, torch.Tensor) else v
                                  for v in resumed]
    topology.destroy()
    return report


@pytest.mark.multirank
def test_gap22_bridge_saves_and_resumes_language_optimizer_state_at_cp2(tmp_path):
    """Stock save validation rejects every case's MiMo optimizer objects as duplicated over CP;
    with the bridges each CP rank resumes exactly the Adam state it saved, and CP ranks of a
    non-distributed optimizer hold the same state."""
    ranks = run_in_processes(_language_cp2_checkpoints, 2, timeout=240, simulated=True,
                             args=(str(tmp_path),))
    stock = {case: ranks[0][case]["stock"] for case in CP2_CASES}
    duplicated = "Invalid sharding pattern validation. Errors: Duplicate ShardedObject keys: "
    assert stock == {
        "bf16 dist-opt dp_reshardable":
            f"{duplicated}['mimo.language.optimizer.mimo.language.param_state_sharding_type/shard_0_1']",
        "bf16 dist-opt fully_reshardable":
            f"{duplicated}['mimo.language.optimizer.mimo.language.param_groups/shard_0_1']",
        "bf16": f"{duplicated}['mimo.language.optimizer.mimo.language.param_groups/shard_0_1']",
        "fp32 dist-opt dp_reshardable":
            f"{duplicated}['mimo.language.optimizer.mimo.language.param_state_sharding_type/shard_0_1']",
    }
    assert [rank[case]["saved"] for rank in ranks for case in CP2_CASES] == [True] * 8
    assert [rank[case]["resumed"] for rank in ranks for case in CP2_CASES] == [True] * 8
    assert ranks[0]["bf16"]["digest"] == ranks[1]["bf16"]["digest"]


def _sync_save(folder: str, bridged: bool) -> dict:
    """On a one-rank world: a synchronous ``torch_dist`` save of one tensor, stock or with the
    Gap 35 bridge; which child processes the rank has after it, and the tensor loaded back."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import multiprocessing

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
    keep_save_results_in_process(async_save=not bridged)
    before = {child.pid for child in multiprocessing.active_children()}
    weight = torch.arange(6.0).reshape(2, 3)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, folder)
    started = [type(child).__name__ for child in multiprocessing.active_children()
               if child.pid not in before]
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}
    loaded = dist_checkpointing.load(template, folder)["w"]
    return {"started": started, "queue": type(filesystem_async._results_queue).__name__,
            "round trip": bool(torch.equal(loaded, weight))}


@pytest.mark.multirank
def test_gap35_canary_stock_save_results_queue_spawns_a_manager_process(tmp_path):
    """Stock's synchronous save starts a spawn-context Manager process on the rank (re-importing
    its main script there) just to carry the write results back to the same rank."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert inspect.signature(filesystem_async.get_write_results_queue).parameters[
        "mp_mode"].default == "spawn"
    [stock] = run_in_processes(_sync_save, 1, timeout=120, simulated=True,
                               args=(str(tmp_path), False))
    assert stock == {"started": ["SpawnProcess"], "queue": "AutoProxy[Queue]",
                     "round trip": True}


@pytest.mark.multirank
def test_gap35_bridge_saves_synchronously_without_a_second_process(tmp_path):
    """With the bridge the same save starts no process, keeps the results in a plain queue and
    loads back the tensor it wrote; ``--async-save`` keeps stock's queue (the canary's run)."""
    [bridged] = run_in_processes(_sync_save, 1, timeout=120, simulated=True,
                                 args=(str(tmp_path), True))
    assert bridged == {"started": [], "queue": "Queue", "round trip": True}
