"""Bridges for gaps in the released megatron-core 0.19.2 wheel, applied explicitly by our entry points.

Each bridge acts only when called (never on import) and documents the gap it closes; its test in
``tests/unit_tests/test_megatron_compat.py`` fails when the wheel changes underneath it, so a
bridge that became unnecessary is noticed and removed. :func:`install` (Gap 1) is for every entry
point; the others are applied by the MiMo code path that needs them.

Gap 1 (dataset helpers): stock ``pretrain()`` calls ``megatron.core.datasets.utils.compile_helpers``,
which runs ``make`` in a folder the wheel ships without a Makefile, so every process exits with
code 1. The wheel does ship the prebuilt ``helpers_cpp`` extension; when it imports there is
nothing to compile.

Gap 2 (disjoint grids): the local attention kernel borrows scratch space from
``parallel_state``'s global memory buffer, which only ``initialize_model_parallel`` creates. With
``skip_model_parallel_init=True`` (every heterogeneous run) nothing creates it, so the first local
attention forward asserts. :func:`ensure_global_memory_buffer` creates it, once.

Gap 3 (explicit groups in checkpoints): ``MegatronModule.sharded_state_dict`` shards a module's
own parameters on ``self.tp_group`` and falls back to ``parallel_state``'s (uninitialized on
disjoint grids) when a module has none, as ``CLIPViTModel`` and other modules not yet ported to
explicit process groups do. :func:`bind_tp_group` gives every such module its grid's TP group.

Gap 4 (MoE block spec per pipeline stage): for an MoE GPT without an explicit layer spec the stock
builder calls ``get_gpt_decoder_block_spec`` without ``pp_rank`` (training/models/gpt.py,
``default_layer_spec``), which then reads ``parallel_state``'s pipeline rank, uninitialized on
disjoint grids. :func:`with_explicit_moe_spec` resolves the block spec for the grid's own
pipeline rank. Hybrid models need no such bridge: ``HybridModel`` picks each stage's layers
from ``pg_collection.pp`` and its MoE layer spec does not depend on the stage.

Gap 4a (MoE experts on one expert rank with biases): an expert ``RowParallelLinear`` skips its
TP reduce only when ``explicit_expert_comm`` (expert TP > 1 or EP > 1, tensor_parallel/
layers.py:1326). With one expert-TP rank and EP 1 it calls ``reduce_from_tensor_model_parallel_
region``, whose autograd function returns its input as is (mappings.py:27-28, 230-232), so the
output is a custom-Function view; ``MLP.forward`` then adds the expert bias into it in place
(transformer/mlp.py:350-354, ``output += output_bias * per_token_scale``) and autograd refuses:
"Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace". It is
not specific to the CPU simulation: stock GPT with the local spec, ``--num-experts`` and the
default ``--add-bias-linear`` crashes the same way. Bridge
(:func:`direct_single_rank_expert_output`): such experts' ``RowParallelLinear`` take the
``explicit_expert_comm`` path, which hands the matmul output on unchanged; the skipped reduce
is the identity on one rank (forward and backward), so results are unchanged.

Gap 4b (``--use-cpu-initialization`` with EP > 1): CPU initialization draws every weight from
the default CPU generator (``_initialize_affine_weight_cpu``, tensor_parallel/layers.py:184-227),
seeded identically on every expert-parallel rank of a pipeline stage, and ``SequentialMLP``
builds its local experts from it in order (transformer/moe/experts.py:1293-1302): the experts
of ep rank 1 are exact copies of ep rank 0's. (GPU initialization forks the expert-parallel RNG
tracker instead.) Bridge (:func:`distinct_cpu_init_experts`, around the build): each
``SequentialMLP`` draws one layer seed from the default generator (the same draw on every
rank, so non-expert weights stay replicated) and builds global expert ``g`` from a generator
seeded with ``layer seed + g``, then restores the default generator. Every expert gets its own
weights, the same for a given ``--seed`` whatever the EP size.

Gap 4c (hybrid models without Transformer Engine): the wheel's only training stack spec for
``HybridModel`` (models/hybrid/hybrid_layer_specs.py, ``hybrid_stack_spec``) is built from TE
modules whatever ``--transformer-impl`` says, and ``HybridStack`` builds its final norm as
``TENorm`` unconditionally (models/hybrid/hybrid_block.py:213-219). Without TE those names are
``MagicMock`` stand-ins or raise ``ImportError`` (``StopIteration`` inside ``MLPLayer``).
Bridge (:func:`with_local_hybrid_spec`): with ``--transformer-impl local`` and no ``--spec``,
attention, MLP and MoE layers come from the GPT local spec's modules and the final norm is the
local norm; other layer types (Mamba, GDN, MLA, DSA, MTP) keep the stock spec.

Gap 5 (MiMo optimizer checkpoints, any precision): ``dist_checkpointing.save`` writes the *common*
(non-sharded) part of the state dict from global rank 0 only (core/dist_checkpointing/
serialization.py:439-445) and every rank reads that copy back (serialization.py:151-152). On
disjoint grids rank 0 runs the first encoder, so every optimizer value another module keeps as a
plain object is dropped. ``MimoOptimizer.sharded_state_dict`` moves ``param_groups`` into a
``ShardedObject`` only when the module dict has an ``'optimizer'`` key (core/models/mimo/
optimizer.py:233-235); ``FP32Optimizer`` (fp32 params) returns torch's flat ``{'state',
'param_groups'}`` and both ``FP32Optimizer`` and ``Float16OptimizerWithFloat16Params`` keep the
Adam step as a plain ``state['common_step']`` (core/optimizer/optimizer.py:1176-1188, 1368-1377).
The language model then resumes with ``param_groups == [{'params': [...]}]`` (fp32: "Could not
find parameter group with key ...") or without a step (bf16: ``KeyError: 'step'``).
Bridge: every plain value of each active module's optimizer dict is also saved in one
``ShardedObject`` per module (sharded over the module's (pp, tp), replicated over its dp x cp, like
the stock RNG state) and written back at its path before the stock load.

Gap 6 (``--use-distributed-optimizer`` resume): with plain ``torch.optim.Adam/AdamW`` (no Transformer
Engine / Apex: ``distrib_optimizer.HAVE_APEX_OR_TE`` False, always on the CPU simulation)
``DistributedOptimizer.state_dict()`` asserts on a fresh optimizer (distrib_optimizer.py:837-840),
which the load template always is (:1532); its ``load_state_dict()`` gives every parameter one
shared step tensor (:1024-1032) that the param-state load then overwrites with the template's
step (:1949-1953, :1219-1225), so the resumed run restarts Adam at step 0 and counts once per
parameter. Independently of TE, fp32 main params are views of the model params and the
``dp_reshardable`` param-state load ``copy_``s into them outside ``torch.no_grad`` ("a view of a
leaf Variable that requires grad is being used in an in-place operation").
Bridge: load under ``torch.no_grad()``; without TE/Apex a fresh optimizer reports step 0 and after
loading each parameter gets its own step tensor holding the step saved in ``param_groups``.

Gap 7 (``--help``): argparse expands ``%`` in help strings; the stock help of
``--moe-paged-stash-buffer-size-factor-cuda`` has a bare ``%`` (training/arguments.py), so
``--help`` of every stock entry point dies with ``ValueError: unsupported format character``.
Bridge: :func:`escape_unformattable_help` doubles the ``%`` of every help string argparse could
not expand, on the one parser it is given.

Gap 8 (MiMo optimizer scalars): ``MimoOptimizer.step`` (core/models/mimo/optimizer.py:76-111)
issues three world-wide all-reduces per step, each a barrier across every GPU of every module:
found-inf (MAX), the per-module squared grad norms (MAX, in ``get_grad_norm``) and update
success (MIN). The first two have no data dependency between them; the third only matters when
some optimizer can report failure, and every ``step_with_ready_grads`` of the 0.19.2 wheel
returns True. Bridge (:func:`install_step_bridges`, MiMo processes only): one MAX all-reduce of
``[found_inf, may_fail, norm_sq...]`` with stock's values, so the grad norm is bit-identical;
the success MIN runs only when some rank's optimizer is not a known always-succeeding one.

Gap 9 (cross-grid shape handshake): ``BridgeCommunicator`` exchanges tensor shapes before every
activation and gradient transfer (``_communicate_shapes``, core/pipeline_parallel/
bridge_communicator.py:864), whatever ``tensor_shape`` the schedule passes, and the schedule
refuses multi-module pipelines without ``variable_seq_lengths`` (schedules.py:2182). MiMo
transfer shapes are fixed by ``--seq-length``, the micro-batch sizes and each encoder's
``tokens_per_sample``. Bridge (:func:`exchange_shapes_once`): each bridge exchanges each
direction's shapes on its first transfer and reuses them; a transfer of another shape raises.

Gap 10 (data loader state on disjoint grids): stock ``save_checkpoint`` hands the training
iterator to ``maybe_save_dataloader_state`` (training/checkpointing.py:1218-1293), which writes
``train_dataloader_dprank{dp}.pt`` from tensor rank 0 of the first pipeline stage of every DP
replica, named by the DP rank alone. On disjoint grids every module has a DP rank 0, so encoder
and language replicas write the same file and the last writer wins. Bridge
(:func:`install_checkpoint_bridges`): an iterator that knows its module
(``MicrobatchStream.save_data_state``) writes ``dataloader/<module>_dp<rank>.pt`` inside the
iteration folder, before the folder's ``metadata.json``; any other iterator gets stock's
function.

Gap 11 (the rerun state machine's world check): in its default ``validate_results`` mode the
stock state machine all-reduces its "rerun this step" flag over the whole world once per step
(``_reduce_any``, core/rerun_state_machine.py:254-270, called from
``should_run_forward_backward`` at :329), one more barrier across every module. The flag is
final once the step's last result check has run (loss checks in the forward pass, gradient
checks before the DP reduce, param_and_grad_buffer.py:340-360), which is before the MiMo
gradient finalization's token count. Bridge (:func:`rerun_vote`, :func:`settle_rerun_vote`,
applied by :func:`install_step_bridges`): the token-count all-reduce carries each rank's flag,
and the machine's next single-flag check of that step returns the summed answer instead of
reducing again; a flag that changed in between raises rather than diverging.

Gap 12 (bridge broadcasts inside one-rank grids): after every cross-grid transfer the receiving
grid's leader broadcasts the shape and then the tensor to the rest of its grid
(bridge_communicator.py:436-446 and the same pair in each transfer method), also when that grid
is the leader alone, where a broadcast is the identity. Bridge (:func:`skip_lone_broadcasts`):
the ``torch.distributed`` the bridge module sees skips broadcasts in one-member groups; every
other call is torch's.

Gap 13 (pipeline-stage shape handshake): for the same reason (``variable_seq_lengths``) each
language pipeline stage's ``P2PCommunicator`` exchanges shapes before every stage-to-stage
transfer (``_communicate_shapes``, core/pipeline_parallel/p2p_communication.py:186, called from
``_communicate`` at :322), though MiMo stage activations are always ``[seq, micro-batch,
hidden]``. Bridge (:func:`exchange_shapes_once`, with Gap 9): each stage link exchanges each
direction's shapes on its first transfer and reuses them; a transfer of another shape raises.

Gap 14 (fp32 router buffers under ``--bf16`` / ``--fp16``): a router keeps its ``expert_bias`` in
fp32 (``TopKRouter._maintain_float32_expert_bias``, core/transformer/moe/router.py:259), but only
casts it back on its next forward, load or save; ``Float16Module`` (transformer/module.py:458-464)
first casts the whole module, so a bias set before the wrap (imported HF weights, a Megatron
checkpoint init) is rounded to bf16 and routes differently. Stock ``--load`` runs after the wrap
and is exact. Bridge (:func:`exact_fp32_router_buffers`): around the wrap, every router buffer
that is fp32 before and kept fp32 by the router is put back to its exact value.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

_installed = False


class MegatronCompatError(RuntimeError):
    """The installed megatron-core lacks something our bridges need."""


def prebuilt_dataset_helpers_available() -> bool:
    """Whether the wheel's compiled dataset index helpers import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    return True


def _use_prebuilt_dataset_helpers() -> None:
    if not prebuilt_dataset_helpers_available():
        raise MegatronCompatError(
            "megatron.core.datasets.helpers_cpp does not import, and the megatron-core wheel ships "
            "no Makefile to build it. Reinstall megatron-core==0.19.2 from a binary wheel for this "
            "Python (pip install --force-reinstall --only-binary=:all: megatron-core==0.19.2)."
        )


def install() -> None:
    """Apply Gap 1 (every entry point needs it; the MiMo bridges are applied where MiMo code
    needs them). Idempotent; call before stock ``pretrain()``."""
    global _installed
    if _installed:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = _use_prebuilt_dataset_helpers
    _installed = True


def ensure_global_memory_buffer() -> None:
    """Create ``parallel_state``'s global memory buffer unless it exists (Gap 2)."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def bind_tp_group(module: torch.nn.Module, tp_group: torch.distributed.ProcessGroup) -> None:
    """Give every ``MegatronModule`` inside ``module`` lacking a ``tp_group`` this one (Gap 3)."""
    from megatron.core.transformer.module import MegatronModule

    for child in module.modules():
        if isinstance(child, MegatronModule) and not hasattr(child, "tp_group"):
            child.tp_group = tp_group


def with_explicit_moe_spec(model_config: Any, pp_rank: int) -> Any:
    """``model_config`` itself, or for a stock-spec MoE GPT a copy with its block spec resolved
    for pipeline rank ``pp_rank`` (Gap 4)."""
    transformer = model_config.transformer
    # Hybrid configs have no layer spec (HybridModelConfig raises AttributeError for it).
    if (transformer.num_moe_experts is None or not hasattr(model_config, "transformer_layer_spec")
            or model_config.transformer_layer_spec is not None):
        return model_config
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    resolved = copy.copy(model_config)
    resolved.transformer_layer_spec = get_gpt_decoder_block_spec(
        transformer, use_transformer_engine=transformer.transformer_impl == "transformer_engine",
        normalization=transformer.normalization, qk_l2_norm=transformer.qk_l2_norm,
        pp_rank=pp_rank,
    )
    return resolved


def direct_single_rank_expert_output(model: torch.nn.Module) -> None:
    """Route every expert ``RowParallelLinear`` whose TP reduce is the identity (one expert-TP
    rank, EP 1) past that reduce, as stock does for EP > 1 (Gap 4a)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    for module in model.modules():
        if (isinstance(module, RowParallelLinear) and module.is_expert
                and not module.explicit_expert_comm and module.skip_bias_add):
            module.explicit_expert_comm = True


@contextlib.contextmanager
def exact_fp32_router_buffers(module: torch.nn.Module) -> Iterator[None]:
    """While open, a precision wrapper's cast leaves the routers' fp32 buffers exact (Gap 14)."""
    kept = [(router, {name: buffer.clone() for name, buffer in router.named_buffers(recurse=False)
                      if buffer.dtype == torch.float32 and not buffer.is_meta})
            for router in module.modules() if hasattr(router, "_maintain_float32_expert_bias")]
    yield
    with torch.no_grad():
        for router, buffers in kept:
            router._maintain_float32_expert_bias()
            for name, value in buffers.items():
                buffer = getattr(router, name)
                if buffer.dtype == torch.float32:
                    buffer.copy_(value)


@contextlib.contextmanager
def distinct_cpu_init_experts() -> Iterator[None]:
    """While open, CPU-initialized ``SequentialMLP`` experts get per-expert weights (Gap 4b)."""
    from megatron.core.transformer.moe import experts

    stock_init = experts.SequentialMLP.__init__
    stock_mlp = experts.MLP

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        if not (config.use_cpu_initialization and config.perform_initialization):
            stock_init(self, num_local_experts, config, submodules, pg_collection, name)
            return
        generator = torch.default_generator
        layer_seed = int(torch.randint(2**62, (1,), generator=generator))
        global_index = itertools.count(pg_collection.ep.rank() * num_local_experts)

        def expert(*args, **kwargs):
            state = generator.get_state()
            generator.manual_seed(layer_seed + next(global_index))
            try:
                return stock_mlp(*args, **kwargs)
            finally:
                generator.set_state(state)

        experts.MLP = expert
        try:
            stock_init(self, num_local_experts, config, submodules, pg_collection, name)
        finally:
            experts.MLP = stock_mlp

    experts.SequentialMLP.__init__ = __init__
    try:
        yield
    finally:
        experts.SequentialMLP.__init__ = stock_init


def _local_norm(config: Any) -> type:
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider().layer_norm(rms_norm=config.normalization == "RMSNorm")


@functools.cache
def _local_norm_hybrid_stack() -> type:
    """``HybridStack`` with the local spec's final norm in place of its hard-wired ``TENorm``."""
    from megatron.core.models.hybrid.hybrid_block import HybridStack

    class LocalNormHybridStack(HybridStack):
        """``HybridStack`` whose final norm is the local spec's norm (Gap 4c)."""

        def __init__(self, *args: Any, post_layer_norm: bool = True, **kwargs: Any) -> None:
            super().__init__(*args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = _local_norm(self.config)(
                    config=self.config, hidden_size=self.config.hidden_size,
                    eps=self.config.layernorm_epsilon,
                )

    return LocalNormHybridStack


def with_local_hybrid_spec(model_config: Any) -> Any:
    """``model_config`` itself, or for a hybrid model with ``--transformer-impl local`` and no
    explicit stack spec a copy whose stack spec uses no Transformer Engine module (Gap 4c)."""
    transformer = model_config.transformer
    if (not hasattr(model_config, "hybrid_stack_spec") or model_config.hybrid_stack_spec is not None
            or transformer.transformer_impl != "local"):
        return model_config
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = dict(qk_layernorm=transformer.qk_layernorm, normalization=transformer.normalization,
                 qk_l2_norm=transformer.qk_l2_norm)
    dense = get_gpt_layer_local_submodules(**local)
    # The TE spec's layers fuse these norms into their first linear; keep its checkpoint keys.
    attention_norm_key = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    mlp_norm_key = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    submodules = dataclasses.replace(
        hybrid_stack_spec.submodules,
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=dense.input_layernorm, self_attention=dense.self_attention,
            self_attn_bda=dense.self_attn_bda,
            sharded_state_dict_keys_map=attention_norm_key,
        )),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda,
            sharded_state_dict_keys_map=mlp_norm_key,
        )),
    )
    if transformer.num_moe_experts is not None:
        moe = get_gpt_layer_local_submodules(num_experts=transformer.num_moe_experts,
                                             moe_grouped_gemm=transformer.moe_grouped_gemm, **local)
        submodules.moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=(
            TransformerLayerSubmodules(pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp,
                                       mlp_bda=moe.mlp_bda)))
    resolved = copy.copy(model_config)
    resolved.hybrid_stack_spec = ModuleSpec(module=_local_norm_hybrid_stack(),
                                            submodules=submodules)
    return resolved


COMMON_STATE_KEY = "_mimo_module_common_state"
"""Where the per-module ShardedObject sits inside a module's optimizer state dict."""

_checkpoint_bridges_installed = False


def _is_sharded(value: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    return isinstance(value, (ShardedBase, LocalNonpersistentObject))


def _holds_sharded(value: Any) -> bool:
    if _is_sharded(value):
        return True
    if isinstance(value, dict):
        return any(_holds_sharded(item) for item in value.values())
    if isinstance(value, list):
        return any(_holds_sharded(item) for item in value)
    return False


def plain_values(tree: Any, path: tuple = ()) -> dict[tuple, Any]:
    """Copies of every largest subtree of ``tree`` holding no sharded object, by path."""
    found: dict[tuple, Any] = {}
    for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if _is_sharded(value):
            continue
        if isinstance(value, (dict, list)) and _holds_sharded(value):
            found.update(plain_values(value, path + (key,)))
        else:
            found[path + (key,)] = copy.deepcopy(value)
    return found


def put_plain_values(tree: Any, values: dict[tuple, Any], module: str) -> None:
    """Write ``values`` (from :func:`plain_values`) back into ``tree`` at their paths."""
    for path, value in values.items():
        node = tree
        for key in path[:-1]:
            if isinstance(node, dict):
                node = node.setdefault(key, {})
            elif isinstance(node, list) and isinstance(key, int) and key < len(node):
                node = node[key]
            else:
                raise ValueError(
                    f"optimizer checkpoint of MiMo module {module!r}: the saved value at {path} "
                    "does not fit this run's optimizer (other optimizer settings or layout?)"
                )
        node[path[-1]] = value


def _install_mimo_module_common_state() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.models.mimo.optimizer import MimoOptimizer

    stock_sharded_state_dict = MimoOptimizer.sharded_state_dict
    stock_load_state_dict = MimoOptimizer.load_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        state = stock_sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)
        for name, info in self.module_infos.items():
            module_sd = state.get(name)
            if not (info.is_active and info.optimizer and isinstance(module_sd, dict)):
                continue
            pgc = info.pg_collection
            # Always added, even empty: a load template (fresh optimizer, no step yet) must ask
            # for the object whenever a save wrote it.
            module_sd[COMMON_STATE_KEY] = ShardedObject(
                f"optimizer.mimo.{name}.module_common_state",
                plain_values(module_sd),
                (pgc.pp.size(), pgc.tp.size()),
                (pgc.pp.rank(), pgc.tp.rank()),
                replica_id=pgc.dp_cp.rank(),
            )
        return state

    def load_state_dict(self, state_dict):
        for name, info in self.module_infos.items():
            module_sd = state_dict.get(name)
            if info.is_active and info.optimizer and isinstance(module_sd, dict):
                values = module_sd.pop(COMMON_STATE_KEY, None)
                if values is not None:
                    put_plain_values(module_sd, values, name)
        return stock_load_state_dict(self, state_dict)

    sharded_state_dict.__doc__ = stock_sharded_state_dict.__doc__
    load_state_dict.__doc__ = stock_load_state_dict.__doc__
    MimoOptimizer.sharded_state_dict = sharded_state_dict
    MimoOptimizer.load_state_dict = load_state_dict


def _install_distributed_optimizer_resume() -> None:
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE
    stock_state_dict = DistributedOptimizer.state_dict
    stock_load_state_dict = DistributedOptimizer.load_state_dict

    def state_dict(self):
        inner = self.optimizer
        if not torch_adam or inner is None or any("step" in s for s in inner.state.values()):
            return stock_state_dict(self)
        # Fresh torch Adam (no step taken, nothing loaded): stock asserts on the empty step set.
        result = {"optimizer": {k: v for k, v in inner.state_dict().items() if k != "state"}}
        for group in result["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0.0
        if self.grad_scaler:
            result["grad_scaler"] = self.grad_scaler.state_dict()
        return result

    def load_state_dict(self, state_dict):
        with torch.no_grad():
            stock_load_state_dict(self, state_dict)
        if torch_adam and self.optimizer is not None and not self.ddp_config.use_megatron_fsdp:
            steps = {group.get("step") for group in state_dict["optimizer"]["param_groups"]}
            steps.discard(None)
            if len(steps) != 1:
                raise ValueError(f"DistributedOptimizer checkpoint holds steps {sorted(steps)}")
            step = float(steps.pop())
            for param_state in self.optimizer.state.values():
                param_state["step"] = torch.tensor(step, dtype=torch.float32)

    state_dict.__doc__ = stock_state_dict.__doc__
    load_state_dict.__doc__ = stock_load_state_dict.__doc__
    DistributedOptimizer.state_dict = state_dict
    DistributedOptimizer.load_state_dict = load_state_dict


def _install_module_data_state() -> None:
    from megatron.training import checkpointing

    stock = checkpointing.maybe_save_dataloader_state

    def maybe_save_dataloader_state(train_iterator, iteration, dataloader_save_path, **groups):
        save = getattr(getattr(train_iterator, "iterable", None), "save_data_state", None)
        if save is None or not dataloader_save_path:
            return stock(train_iterator, iteration, dataloader_save_path, **groups)
        save(checkpointing.get_checkpoint_name(dataloader_save_path, iteration,
                                               return_base_dir=True))

    maybe_save_dataloader_state.__doc__ = stock.__doc__
    checkpointing.maybe_save_dataloader_state = maybe_save_dataloader_state


def install_checkpoint_bridges() -> None:
    """Apply Gaps 5, 6 and 10. Idempotent; the MiMo builder calls it before stock ``pretrain()``
    builds the optimizer (MiMo processes only: stock callers keep stock checkpoint behaviour)."""
    global _checkpoint_bridges_installed
    if _checkpoint_bridges_installed:
        return
    _install_mimo_module_common_state()
    _install_distributed_optimizer_resume()
    _install_module_data_state()
    _checkpoint_bridges_installed = True


def _help_expands(action: Any, parser: Any) -> bool:
    """Whether argparse can expand ``action.help`` (it formats it with the action's attributes)."""
    try:
        (action.help or "") % {**vars(action), "prog": parser.prog}
    except (ValueError, TypeError, KeyError):
        return False
    return True


def escape_unformattable_help(parser: Any) -> list[str]:
    """Double the ``%`` of every help string of ``parser`` that breaks ``--help`` (Gap 7).

    Returns the first option string of each action it escaped.
    """
    escaped = []
    for action in parser._actions:
        if action.help and not _help_expands(action, parser):
            action.help = action.help.replace("%", "%%")
            escaped.append(action.option_strings[0] if action.option_strings else action.dest)
    return escaped

# Gap 8: the MiMo optimizer's world-wide scalars (see the module docstring).

_SUCCEEDING_STEPS: tuple[str, ...] = (
    "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.step_with_ready_grads",
    "megatron.core.optimizer.optimizer:FP32Optimizer.step_with_ready_grads",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.step_with_ready_grads",
)
"""``step_with_ready_grads`` implementations of the 0.19.2 wheel that always return True."""


def _resolve(path: str) -> Any:
    module, _, attrs = path.partition(":")
    value: Any = importlib.import_module(module)
    for attr in attrs.split("."):
        value = getattr(value, attr)
    return value


def always_succeeds(optimizer: Any) -> bool:
    """Whether ``optimizer.step_with_ready_grads()`` can only return True (a chain: every link)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return all(always_succeeds(inner) for inner in optimizer.chained_optimizers)
    known = {_resolve(path) for path in _SUCCEEDING_STEPS}
    return type(optimizer).step_with_ready_grads in known


def _folded_mimo_step(self: Any) -> tuple[bool, float | None, int | None]:
    """``MimoOptimizer.step`` with its found-inf, grad-norm and may-fail scalars in one world
    all-reduce (MAX); the success all-reduce only when some rank's optimizer may fail."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = self.prepare_grads()
    infos = sorted(self.module_infos.items())
    # [found_inf, may_fail, squared grad norm of each module in name order]: stock's values.
    scalars = torch.zeros(2 + len(infos), device="cuda", dtype=torch.float32)
    scalars[0] = float(found_inf)
    scalars[1] = float(not all(always_succeeds(opt) for opt in self._active_optimizers))
    for index, (_, info) in enumerate(infos):
        if info.is_active and info.optimizer:
            scalars[2 + index] = (info.optimizer.get_grad_norm() or 0.0) ** 2
    torch.distributed.all_reduce(scalars, op=torch.distributed.ReduceOp.MAX)
    if scalars[0].item() > 0:
        return False, None, None
    grad_norm = torch.sqrt(scalars[2:].sum()).item()
    for opt in self._active_optimizers:
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad,
                                         total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer)
    num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
    success = self.step_with_ready_grads()
    if scalars[1].item() > 0:
        flag = torch.tensor([1 if success else 0], dtype=torch.int, device="cuda")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        success = bool(flag.item())
    elif not success:
        raise MegatronCompatError("an optimizer listed as always succeeding reported failure")
    return success, grad_norm, num_zeros


def install_step_bridges() -> None:
    """Apply Gaps 8 (``MimoOptimizer.step``) and 11 (the rerun check). Idempotent; the MiMo
    builder calls it (MiMo processes only: stock optimizers are not touched)."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer
    from megatron.core.rerun_state_machine import RerunStateMachine

    MimoOptimizer.step = _folded_mimo_step
    if RerunStateMachine._reduce_any is not _settled_reduce_any:
        global _stock_reduce_any
        _stock_reduce_any = RerunStateMachine._reduce_any
        RerunStateMachine._reduce_any = _settled_reduce_any


# Gap 11: the rerun state machine's world check rides in the token count (module docstring).

_stock_reduce_any: Any = None
_settled_vote: tuple[int, int, bool] | None = None
"""(rerun machine iteration, this rank's vote, the world's answer) of the step being finished."""


def rerun_vote() -> int:
    """This rank's "rerun the step" flag, read after the step's last result check (Gap 11)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    return int(bool(get_rerun_state_machine().rerun_requested))


def settle_rerun_vote(vote: int, world_sum: int) -> None:
    """Record the world-wide sum of the step's votes for the machine's check of this step."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    global _settled_vote
    _settled_vote = (get_rerun_state_machine().current_iteration, vote, world_sum > 0)


def _settled_reduce_any(self: Any, value: Any) -> Any:
    """Stock ``_reduce_any``, except the initial run's single flag once the token count settled it."""
    from megatron.core.rerun_state_machine import RerunState

    global _settled_vote
    settled, _settled_vote = _settled_vote, None
    if (settled is None or isinstance(value, list) or self.state != RerunState.INITIAL_RUN
            or settled[0] != self.current_iteration):
        return _stock_reduce_any(self, value)
    if int(bool(value)) != settled[1]:
        raise MegatronCompatError(
            "the rerun state machine's flag changed after the gradient token count carried it; "
            "a result check now runs after gradient finalization (megatron_compat Gap 11)")
    return settled[2]


# Gaps 9 and 13: shape handshakes of static transfers (see the module docstring).


class _ShapeMemo:
    """The shapes one side of a link exchanged on its first transfer of each kind."""

    def __init__(self, link: str) -> None:
        self.link = link
        self.known: dict[str, Any] = {}

    def sent_before(self, kind: str, shapes: Any) -> bool:
        """True when ``kind`` was exchanged before (and ``shapes`` match it); remembers them."""
        if kind not in self.known:
            self.known[kind] = shapes
            return False
        if shapes != self.known[kind]:
            raise MegatronCompatError(
                f"{self.link} transfer changed shape {self.known[kind]} -> {shapes}; the layout "
                "declared static shapes")
        return True

    def new(self, kind: str, receiving: bool) -> bool:
        """Whether a receive of ``kind`` still needs the peer's shape."""
        return receiving and kind not in self.known


def exchange_shapes_once(communicator: Any) -> None:
    """Make each cross-grid bridge (Gap 9) and each pipeline-stage link (Gap 13) of this rank's
    modules exchange each direction's shapes once.

    For layouts whose transfer shapes never change (fixed ``--seq-length``, micro-batch sizes and
    tokens per encoder sample). A later transfer of another shape raises instead of hanging.
    """
    for bridge in communicator.bridge_comms:
        _static_bridge_shapes(bridge)
    for name, info in communicator.rank_module_map.items():
        if info.pp_size > 1:
            _static_stage_shapes(info.p2p_communicator, name)


def _static_bridge_shapes(bridge: Any) -> None:
    stock = bridge._communicate_shapes
    memo = _ShapeMemo(f"cross-grid {bridge.src_module_name}->{bridge.dest_module_name}")

    def communicate_shapes(tensor_to_send_next=None, recv_next=False, recv_prev=False,
                           tensor_to_send_prev=None):
        info = bridge.comm_map.get(bridge.current_rank)
        if not info or info.role.name == "MEMBER":
            return stock(tensor_to_send_next, recv_next, recv_prev, tensor_to_send_prev)

        def sent_before(kind: str, tensors: Any, peers: list[int]) -> bool:
            return memo.sent_before(kind, [tuple(t.shape) for t in
                                           bridge._as_per_peer_tensors(tensors, len(peers))])

        if tensor_to_send_next is not None and sent_before("fwd", tensor_to_send_next,
                                                           info.send_to_ranks):
            tensor_to_send_next = None
        if tensor_to_send_prev is not None and sent_before("grad", tensor_to_send_prev,
                                                           info.recv_from_ranks):
            tensor_to_send_prev = None
        new_next, new_prev = memo.new("grad", recv_next), memo.new("fwd", recv_prev)
        forward, grads = stock(tensor_to_send_next, new_next, new_prev, tensor_to_send_prev)
        if new_next:
            memo.known["grad"] = grads
        if new_prev:
            memo.known["fwd"] = forward
        return (memo.known["fwd"] if recv_prev else [], memo.known["grad"] if recv_next else [])

    bridge._communicate_shapes = communicate_shapes


def _static_stage_shapes(p2p: Any, module: str) -> None:
    stock = p2p._communicate_shapes
    memo = _ShapeMemo(f"{module} pipeline-stage")

    def communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if tensor_send_next is not None and memo.sent_before("fwd out", list(tensor_send_next.shape)):
            tensor_send_next = None
        if tensor_send_prev is not None and memo.sent_before("grad out", list(tensor_send_prev.shape)):
            tensor_send_prev = None
        new_prev, new_next = memo.new("fwd in", recv_prev), memo.new("grad in", recv_next)
        prev_shape, next_shape = stock(tensor_send_next, tensor_send_prev, new_prev, new_next)
        if new_prev:
            memo.known["fwd in"] = prev_shape
        if new_next:
            memo.known["grad in"] = next_shape
        return (memo.known["fwd in"] if recv_prev else [0, 0, 0],
                memo.known["grad in"] if recv_next else [0, 0, 0])

    p2p._communicate_shapes = communicate_shapes


# Gap 12: broadcasts inside one-rank grids (see the module docstring).


class _LoneBroadcastSkipping:
    """``torch.distributed`` as the bridge module sees it: a broadcast in a one-member group,
    the identity, is skipped; everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None,
                  async_op: bool = False, **kwargs: Any) -> Any:
        if group is not None and not async_op and torch.distributed.get_world_size(group) == 1:
            return None
        return torch.distributed.broadcast(tensor, src=src, group=group, async_op=async_op,
                                           **kwargs)


def skip_lone_broadcasts() -> None:
    """Apply Gap 12 to every ``BridgeCommunicator``. Idempotent; MiMo processes only."""
    from megatron.core.pipeline_parallel import bridge_communicator

    if not isinstance(bridge_communicator.dist, _LoneBroadcastSkipping):
        bridge_communicator.dist = _LoneBroadcastSkipping()
