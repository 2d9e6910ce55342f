"""A plugin left abstract, or raising in ``__init__`` or a build-time hook, is one line naming it;
a plain ``torch.nn.Module`` encoder at tp > 1 is replicated, and the notice says so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_plugins.encoders import EncoderPluginError, check_hooks, instantiate
from megatron_plugins.encoders.base import TensorReplicated
from megatron_plugins.parallel.layout import ModulePlacement

PATH = "tests.fixtures.plain_encoder"
LANGUAGE = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)


def _grid(tp: int, provider: str) -> ModulePlacement:
    return ModulePlacement(name="sensors", tp=tp, pp=1, cp=1, dp=1, rank_offset=0, provider=provider)


def _plugin(cls: str, tp: int = 1):
    provider = f"{PATH}:{cls}"
    return instantiate(provider, "sensors", SimpleNamespace(), _grid(tp, provider))


@pytest.mark.parametrize("cls, message", [
    ("LeftAbstract", f"--encoder sensors={PATH}:LeftAbstract: {PATH}:LeftAbstract is abstract; "
                     "implement encoder_spec, preprocessor"),
    ("RaisesInInit", f"--encoder sensors={PATH}:RaisesInInit: RaisesInInit.__init__ raised "
                     "KeyError: 'sensor_calibration'"),
])
def test_unusable_plugin_classes_are_one_line(cls, message):
    with pytest.raises(EncoderPluginError) as error:
        _plugin(cls)
    assert str(error.value) == message


def test_a_hook_raising_at_build_time_is_one_line():
    with pytest.raises(EncoderPluginError) as error:
        check_hooks(_plugin("RaisesInSpec"), LANGUAGE)
    assert str(error.value) == (f"--encoder sensors={PATH}:RaisesInSpec: RaisesInSpec.encoder_spec "
                                "raised RuntimeError: weights file /data/enc.pt not found")


@pytest.mark.parametrize("cls, problem", [
    ("RaisesInPreprocessor", "RaisesInPreprocessor.preprocessor raised FileNotFoundError: "
                             "tokenizer.json"),
    ("ReturnsAFunction", "ReturnsAFunction.preprocessor() returned function, not a "
                         "megatron_plugins.encoders.MediaPreprocessor"),
    ("ReadsVideo", "ReadsVideo.preprocessor(): media 'video' is not one of image, audio; set the "
                   "class attribute media"),
])
def test_an_unusable_preprocessor_is_one_line(cls, problem):
    with pytest.raises(EncoderPluginError) as error:
        check_hooks(_plugin(cls), LANGUAGE)
    assert str(error.value) == f"--encoder sensors={PATH}:{cls}: {problem}"


def test_a_preprocessor_the_loader_workers_cannot_receive_is_one_line():
    with pytest.raises(EncoderPluginError) as error:
        check_hooks(_plugin("HoldsALambda"), LANGUAGE)
    message = str(error.value)
    assert message.startswith(f"--encoder sensors={PATH}:HoldsALambda: HoldsALambda.preprocessor() "
                              "cannot be pickled for the loader workers (")
    assert message.endswith("keep plain attributes (numbers, strings, tuples)")
    assert "\n" not in message


def test_a_plain_module_is_replicated_only_at_tp_above_one():
    assert check_hooks(_plugin("PlainEncoder", tp=1), LANGUAGE) is None
    plugin = _plugin("PlainEncoder", tp=2)
    assert check_hooks(plugin, LANGUAGE) == (
        f"--encoder sensors={PATH}:PlainEncoder: PlainMLP is a plain torch.nn.Module (no "
        "sharded_state_dict), so each of its 2 tp ranks trains a full replica; make it a "
        "MegatronModule with tensor-parallel layers to shard it")
    spec = plugin.submodule_spec(plugin.transformer_config(LANGUAGE), 32, None)
    assert spec.submodules["encoders"]["sensors"].module is TensorReplicated
