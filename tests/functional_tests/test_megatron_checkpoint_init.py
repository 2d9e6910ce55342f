"""Modules start from existing Megatron checkpoints, resharded on load: the language model from
stock pretrain_gpt's TP 2 checkpoint into language PP 2, an encoder from a MiMo run's encoder TP 2
checkpoint into TP 1. The init run saves right away (one step at lr 0), and what it saved is the
sources' tensors exactly; a resumed run ends with its own weights; a missing tensor is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.harness.gpt_runs import train_gpt
from tests.harness.mimo_runs import TINY_MIMO, module_params, train_mimo, train_mimo_rank
from tests.harness.multiprocess import WorkerFailure, run_in_processes
from tests.models.megatron_checkpoints import read_modules, write_checkpoints

pytestmark = pytest.mark.multirank

ENCODER_TP2 = ("--encoder", "vision=vit", "--grid", "vision:tp=2", "--grid", "language:")
LANGUAGE_PP2 = ("--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:pp=2")
UNTIED = ("--untie-embeddings-and-output-weights",)  # a pipelined MiMo language model needs it
TWO_STEPS = ("--train-iters", "2", "--eval-iters", "0", *UNTIED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Stock GPT at TP 2 and a MiMo run at encoder TP 2, each trained 2 steps and saved; a MiMo
    run at language PP 2 / encoder TP 1 started from both; the MiMo run resumed with the init
    flag given too."""
    root = tmp_path_factory.mktemp("init")
    stock, first, init = root / "stock_tp2", root / "mimo_encoder_tp2", root / "init"
    train_gpt(2, (*TWO_STEPS, "--tensor-model-parallel-size", "2", "--save", str(stock),
                  "--save-interval", "2"), tag="ckpt-init")
    _, trained = train_mimo(3, ENCODER_TP2, extra=(*TWO_STEPS, "--save", str(first),
                                                    "--save-interval", "2"), observe_params=True)
    train_mimo(3, LANGUAGE_PP2, extra=(
        "--train-iters", "1", "--eval-iters", "0", "--lr", "0", "--min-lr", "0", *UNTIED,
        "--language-megatron-checkpoint", str(stock), "--encoder-megatron-checkpoint",
        f"vision={first}", "--save", str(init), "--save-interval", "1"))
    # Resumed at its last iteration, it trains no step (and logs no loss): what it holds is what
    # stock --load left after the init.
    resumed = [entry for entries in run_in_processes(
        train_mimo_rank, 3, timeout=150, simulated=True, args=([
            *TINY_MIMO, *ENCODER_TP2, *TWO_STEPS, "--load", str(first),
            "--language-megatron-checkpoint", str(stock)], True, False))
        for entry in entries]  # one entry per module of each rank
    tensors = read_modules([(str(stock), "language"), (str(init), "language"),
                            (str(first), "vision"), (str(init), "vision"),
                            (str(first), "vision:projection"), (str(init), "vision:projection")])
    return root, tensors, trained, resumed


def _assert_equal(source: dict[str, np.ndarray], loaded: dict[str, np.ndarray]) -> None:
    assert sorted(loaded) == sorted(source)
    for name, value in source.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_language_model_starts_from_the_stock_checkpoint_at_another_layout(runs):
    stock, init = runs[1][0], runs[1][1]
    assert "decoder.layers.self_attention.linear_qkv.weight" in stock and len(stock) == 17
    _assert_equal(stock, init)


def test_encoder_starts_from_a_mimo_checkpoint_at_another_tp_and_its_projection_from_init(runs):
    _, _, first, init, first_projection, init_projection = runs[1]
    assert "conv1.weight" in first
    _assert_equal(first, init)
    assert sorted(init_projection) == sorted(first_projection)
    assert not any(np.array_equal(init_projection[n], v) for n, v in first_projection.items())


def test_a_resumed_run_ends_with_its_own_weights_not_the_init(runs):
    stock, trained, resumed = runs[1][0], runs[2], runs[3]
    own = module_params(trained, "language")
    after = module_params(resumed, "language")
    assert sorted(after) == sorted(own)
    for name, value in own.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    [embedding] = [name for name in after if name.endswith("embedding.word_embeddings.weight")]
    assert not np.array_equal(after[embedding], stock["embedding.word_embeddings.weight"])


def test_a_tensor_missing_from_the_checkpoint_is_named_before_training(runs):
    from megatron.core import dist_checkpointing

    root, stock = runs[0], runs[1][0]
    saved = dist_checkpointing.load_common_state_dict(str(root / "stock_tp2" / "iter_0000002"))
    partial = root / "partial"
    write_checkpoints([(partial, {name: torch.from_numpy(stock[name]) for name in
                                  ("embedding.word_embeddings.weight", "output_layer.weight")},
                        vars(saved["args"]))])
    layout = ("--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:")
    with pytest.raises(WorkerFailure) as error:
        train_mimo(2, layout, extra=(*TWO_STEPS, "--language-megatron-checkpoint", str(partial)),
                   timeout=90)
    assert (f"CheckpointInitError: --language-megatron-checkpoint {partial}: the checkpoint has "
            "no tensor decoder.final_layernorm.bias, decoder.final_layernorm.weight, "
            "decoder.layers.mlp.linear_fc1.bias") in str(error.value)
