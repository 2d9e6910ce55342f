"""bf16 precision-aware optimizer settings on real Megatron configs and through stock validate_args.

This machine has no Transformer Engine, so the missing-FusedAdam error is exercised for real.
Where a test needs FusedAdam to exist, ``fake_te`` puts a stand-in with the signature stock checks
under ``transformer_engine.pytorch.optimizers``; nothing here constructs or runs an optimizer.
Megatron is imported before any stand-in exists, so no Megatron module caches it.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
import types
from dataclasses import fields

import megatron.core.utils as megatron_utils
import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import add_megatron_arguments, validate_args
from megatron.training.config.container import PretrainConfigContainer

from megatron_plugins.launch.optimizer_flags import (
    FLAG,
    OptimizerConfigError,
    add_optimizer_args,
    apply_optimizer_args,
    derive_optimizer_configs,
    require_te_fused_adam,
)

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
BF16 = torch.bfloat16
FP32 = torch.float32
FP16 = torch.float16

# A tiny model: enough for stock validate_args.
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 1")


class _FusedAdam:
    """TE FusedAdam's precision-aware keyword arguments, as stock OptimizerConfig checks them."""

    def __init__(self, params, *, master_weight_dtype=None, exp_avg_dtype=None,
                 exp_avg_sq_dtype=None, use_decoupled_grad=False, store_param_remainders=False):
        raise AssertionError("the tests never build an optimizer")


class _OldFusedAdam:
    """A FusedAdam from before precision-aware state."""

    def __init__(self, params, *, lr=1e-3):
        raise AssertionError("the tests never build an optimizer")


def _install_te(monkeypatch: pytest.MonkeyPatch, fused_adam: type) -> None:
    package = types.ModuleType("transformer_engine")
    package.__version__ = "2.8.0"
    package.pytorch = types.ModuleType("transformer_engine.pytorch")
    package.pytorch.optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    package.pytorch.optimizers.FusedAdam = fused_adam
    for module in (package, package.pytorch, package.pytorch.optimizers):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    # Stock caches the TE version on first use; read it from the stand-in, restore it after.
    monkeypatch.setattr(megatron_utils, "_te_version", None)


@pytest.fixture
def fake_te(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_te(monkeypatch, _FusedAdam)


def _changed(before: object, after: object) -> dict[str, object]:
    return {f.name: getattr(after, f.name) for f in fields(before)
            if getattr(after, f.name) != getattr(before, f.name)}


def _bf16_configs(**optimizer_fields) -> tuple[OptimizerConfig, DistributedDataParallelConfig]:
    """The configs stock builds from ``--bf16 --use-distributed-optimizer`` (DDP grads in fp32)."""
    optimizer = OptimizerConfig(**{"bf16": True, "params_dtype": BF16,
                                   "use_distributed_optimizer": True, **optimizer_fields})
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    return optimizer, ddp


def _parse(command: str) -> tuple[argparse.Namespace, list[str]]:
    """Stock parser plus our flag, as ``parse_args(extra_args_provider=add_optimizer_args)``."""
    argv = shlex.split(f"{MODEL} {command}")
    parser = add_optimizer_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(argv)
    args.rank, args.world_size = 0, 1  # stock parse_args reads these from the environment
    return args, argv


def _applied_and_validated(command: str) -> argparse.Namespace:
    args, argv = _parse(command)
    apply_optimizer_args(args, argv)
    validate_args(args)
    return args


# --------------------------------------------------------------------------------------------
# Config objects


def test_bf16_sets_exactly_the_precision_aware_fields(fake_te):
    optimizer, ddp = _bf16_configs()
    new_optimizer, new_ddp = derive_optimizer_configs(optimizer, ddp)
    assert _changed(optimizer, new_optimizer) == {
        "use_precision_aware_optimizer": True,
        "main_grads_dtype": BF16,
        "exp_avg_dtype": BF16,
        "exp_avg_sq_dtype": BF16,
    }
    assert new_optimizer.main_params_dtype == FP32
    # The second field is stock's copy of use_precision_aware_optimizer (Megatron-FSDP only).
    assert _changed(ddp, new_ddp) == {"grad_reduce_in_fp32": False,
                                      "megatron_fsdp_use_decoupled_grad": True}
    # Stock __post_init__ ran on the result: its derived flag routes grads to decoupled_grad.
    assert new_optimizer.use_precision_aware_optimizer_no_fp8_or_ds_fp8 is True
    assert optimizer.use_precision_aware_optimizer is False and ddp.grad_reduce_in_fp32 is True


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_fp16_and_fp32_keep_stock_configs(precision):
    stock = {"fp16": precision == "fp16", "use_distributed_optimizer": True}
    optimizer = OptimizerConfig(**stock)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
    new_optimizer, new_ddp = derive_optimizer_configs(optimizer, ddp)  # needs no TE either
    assert new_optimizer is optimizer and new_ddp is ddp
    assert new_optimizer == OptimizerConfig(**stock)
    assert new_ddp == DistributedDataParallelConfig(use_distributed_optimizer=True)


@pytest.mark.parametrize("chosen, expected", [
    ({"main_grads_dtype": FP32},
     {"main_grads_dtype": FP32, "exp_avg_dtype": BF16, "grad_reduce_in_fp32": True}),
    ({"exp_avg_dtype": FP16}, {"exp_avg_dtype": FP16, "exp_avg_sq_dtype": BF16}),
    ({"exp_avg_sq_dtype": FP32}, {"exp_avg_sq_dtype": FP32, "exp_avg_dtype": BF16}),
    ({"main_params_dtype": FP16}, {"main_params_dtype": FP16, "main_grads_dtype": BF16}),
], ids=["main-grads", "exp-avg", "exp-avg-sq", "main-params"])
def test_chosen_config_fields_win(fake_te, chosen, expected):
    # Stock only allows non-fp32 dtypes together with the precision-aware optimizer.
    optimizer, ddp = _bf16_configs(use_precision_aware_optimizer=True, **chosen)
    new_optimizer, new_ddp = derive_optimizer_configs(optimizer, ddp, explicit=chosen)
    grad_reduce_in_fp32 = expected.pop("grad_reduce_in_fp32", False)
    assert {name: getattr(new_optimizer, name) for name in expected} == expected
    assert new_ddp.grad_reduce_in_fp32 is grad_reduce_in_fp32


@pytest.mark.parametrize("optimizer_fields, ddp_fields, explicit, flag", [
    ({"optimizer": "sgd"}, {}, {"optimizer"}, "--optimizer adam (got 'sgd')"),
    ({"use_distributed_optimizer": False}, {}, set(), "needs --use-distributed-optimizer"),
    ({}, {"use_megatron_fsdp": True}, set(), "--use-megatron-fsdp"),
    ({}, {"grad_reduce_in_fp32": True}, {"grad_reduce_in_fp32"},
     "--accumulate-allreduce-grads-in-fp32 puts the DDP grad buffer in fp32"),
    ({"use_precision_aware_optimizer": True}, {"grad_reduce_in_fp32": False},
     {"main_grads_dtype", "grad_reduce_in_fp32"}, "--grad-reduce-in-bf16 puts"),
    ({}, {}, {"use_precision_aware_optimizer"}, "needs --use-precision-aware-optimizer"),
    ({"use_precision_aware_optimizer": True, "main_params_dtype": BF16}, {},
     {"main_params_dtype"}, "--main-params-dtype bf16"),
], ids=["sgd", "not-distributed", "megatron-fsdp", "accumulate-fp32", "reduce-bf16",
        "precision-aware-off", "bf16-masters"])
def test_config_conflicts_name_the_flag(fake_te, optimizer_fields, ddp_fields, explicit, flag):
    optimizer, ddp = _bf16_configs(**optimizer_fields)
    ddp = DistributedDataParallelConfig(**{"use_distributed_optimizer": True, **ddp_fields})
    with pytest.raises(OptimizerConfigError) as error:
        derive_optimizer_configs(optimizer, ddp, explicit=explicit)
    assert flag in str(error.value)


def test_unknown_explicit_field_is_rejected():
    with pytest.raises(ValueError, match="main_grad_dtype"):
        derive_optimizer_configs(*_bf16_configs(), explicit={"main_grad_dtype"})


# --------------------------------------------------------------------------------------------
# Transformer Engine


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed here")
def test_missing_te_fails_clearly():
    with pytest.raises(ImportError) as error:
        require_te_fused_adam()
    message = str(error.value)
    assert "'from transformer_engine.pytorch.optimizers import FusedAdam' failed" in message
    assert "No module named 'transformer_engine'" in message
    assert FLAG in message
    # Both entry points check before building anything.
    with pytest.raises(ImportError, match="Transformer Engine's FusedAdam"):
        derive_optimizer_configs(*_bf16_configs())
    args, argv = _parse(f"--bf16 --use-distributed-optimizer {FLAG}")
    with pytest.raises(ImportError, match="Transformer Engine's FusedAdam"):
        apply_optimizer_args(args, argv)
    assert args.use_precision_aware_optimizer is False  # nothing set before the failure


def test_old_te_fails_clearly(monkeypatch):
    _install_te(monkeypatch, _OldFusedAdam)
    with pytest.raises(ImportError, match="takes no master_weight_dtype, exp_avg_dtype, "
                                          "exp_avg_sq_dtype, use_decoupled_grad"):
        require_te_fused_adam()


# --------------------------------------------------------------------------------------------
# Flags


def test_named_flags_are_megatrons():
    parser = add_optimizer_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    stock = {option for action in parser._actions for option in action.option_strings}
    named = {"--bf16", "--optimizer", "--use-distributed-optimizer", "--use-megatron-fsdp",
             "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
             "--exp-avg-dtype", "--exp-avg-sq-dtype", "--accumulate-allreduce-grads-in-fp32",
             "--grad-reduce-in-bf16", FLAG}
    assert named <= stock
    assert FLAG == "--bf16-precision-aware-optimizer"


def _container(args: argparse.Namespace) -> PretrainConfigContainer:
    with pytest.warns(UserWarning, match="ModelConfig"):  # stock asks for a model config
        return pretrain_cfg_container_from_args(args)


def test_flag_gives_what_the_stock_flags_give(fake_te):
    ours = _applied_and_validated(f"--bf16 --use-distributed-optimizer {FLAG}")
    by_hand = _applied_and_validated(
        "--bf16 --use-distributed-optimizer --use-precision-aware-optimizer "
        "--main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
    )
    assert vars(ours) == {**vars(by_hand), "bf16_precision_aware_optimizer": True}
    cfg = _container(ours)  # what stock pretrain() gets
    optimizer = cfg.optimizer
    assert (optimizer.use_precision_aware_optimizer, optimizer.main_grads_dtype,
            optimizer.exp_avg_dtype, optimizer.exp_avg_sq_dtype,
            optimizer.main_params_dtype) == (True, BF16, BF16, BF16, FP32)
    assert cfg.ddp.grad_reduce_in_fp32 is False


def test_configs_of_a_stock_container_match_the_flag(fake_te):
    cfg = _container(_applied_and_validated("--bf16 --use-distributed-optimizer"))
    assert cfg.ddp.grad_reduce_in_fp32 is True  # stock bf16
    cfg.optimizer, cfg.ddp = derive_optimizer_configs(cfg.optimizer, cfg.ddp)
    flagged = _container(_applied_and_validated(f"--bf16 --use-distributed-optimizer {FLAG}"))
    assert (cfg.optimizer, cfg.ddp) == (flagged.optimizer, flagged.ddp)


@pytest.mark.parametrize("command", [f"--fp16 {FLAG}", FLAG, "--bf16"],
                         ids=["fp16", "fp32", "bf16-without-flag"])
def test_flag_changes_nothing_for_fp16_fp32_or_when_absent(command):
    args, argv = _parse(f"--use-distributed-optimizer {command}")
    before = dict(vars(args))
    apply_optimizer_args(args, argv)  # needs no TE
    assert vars(args) == before


@pytest.mark.parametrize("chosen, kept, validated", [
    ("--main-grads-dtype fp32", {"main_grads_dtype": "fp32"},
     {"exp_avg_dtype": BF16, "accumulate_allreduce_grads_in_fp32": True}),
    ("--exp-avg-sq-dtype fp32", {"exp_avg_sq_dtype": "fp32"},
     {"exp_avg_dtype": BF16, "accumulate_allreduce_grads_in_fp32": False}),
    ("--exp-avg-dtype=fp16", {"exp_avg_dtype": "fp16"}, {"exp_avg_sq_dtype": BF16}),
    ("--main-params-dtype fp16", {"main_params_dtype": "fp16"}, {"main_grads_dtype": BF16}),
    ("--grad-reduce-in-bf16", {"accumulate_allreduce_grads_in_fp32": False},
     {"main_grads_dtype": BF16, "accumulate_allreduce_grads_in_fp32": False}),
], ids=["main-grads", "exp-avg-sq-default-value", "exp-avg-equals-form", "main-params",
        "reduce-bf16"])
def test_chosen_flags_win_and_pass_stock_validation(fake_te, chosen, kept, validated):
    args, argv = _parse(f"--bf16 --use-distributed-optimizer {FLAG} {chosen}")
    apply_optimizer_args(args, argv)
    assert {name: getattr(args, name) for name in kept} == kept  # as the user wrote them
    validate_args(args)
    assert args.use_precision_aware_optimizer is True
    assert {name: getattr(args, name) for name in validated} == validated


@pytest.mark.parametrize("command, flag", [
    ("--optimizer sgd", "--optimizer adam (got 'sgd')"),
    ("--use-megatron-fsdp", "--use-megatron-fsdp"),
    ("--accumulate-allreduce-grads-in-fp32",
     "--accumulate-allreduce-grads-in-fp32 puts the DDP grad buffer in fp32"),
    ("--main-grads-dtype fp32 --grad-reduce-in-bf16", "--grad-reduce-in-bf16 puts"),
    ("--accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16",
     "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 contradict"),
], ids=["sgd", "megatron-fsdp", "accumulate-fp32", "reduce-bf16", "both-grad-flags"])
def test_flag_conflicts_name_the_flag(command, flag):
    args, argv = _parse(f"--bf16 --use-distributed-optimizer {FLAG} {command}")
    with pytest.raises(OptimizerConfigError) as error:
        apply_optimizer_args(args, argv)  # raised before the TE check
    assert flag in str(error.value)


def test_flag_needs_the_distributed_optimizer():
    args, argv = _parse(f"--bf16 {FLAG}")
    with pytest.raises(OptimizerConfigError, match="needs --use-distributed-optimizer"):
        apply_optimizer_args(args, argv)
