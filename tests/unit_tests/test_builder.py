"""The build config stock pretrain() stores: model description in, live runtime state out."""

from __future__ import annotations

import json

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models.gpt import GPTModelConfig

from megatron_plugins.model.builder import MimoBuildConfig, MimoModelBuilder


def _config() -> MimoBuildConfig:
    language = GPTModelConfig(
        transformer=TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                      calculate_per_token_loss=True),
        vocab_size=128,
    )
    return MimoBuildConfig(language=language,
                           special_token_ids={"vision": 127}, seed=7,
                           freeze_encoders=["vision"], _topology=object(),
                           _plugins={"vision": object()})


def test_stock_finds_the_builder_through_the_config():
    assert _config().get_builder_cls() is MimoModelBuilder
    assert MimoBuildConfig.builder == "megatron_plugins.model.builder.MimoModelBuilder"


def test_runtime_state_never_reaches_the_checkpointed_config():
    saved = _config().as_dict()
    assert not [key for key in saved if key.startswith("_") and key not in ("_target_", "_builder_")]
    assert saved["_target_"] == "megatron_plugins.model.builder.MimoBuildConfig"
    assert saved["special_token_ids"] == {"vision": 127} and saved["freeze_encoders"] == ["vision"]
    assert saved["language"]["vocab_size"] == 128
    text = json.dumps(saved, default=str)
    assert "object at 0x" not in text  # neither the topology nor a plugin object leaked
