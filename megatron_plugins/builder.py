"""The import path stock saves for the MiMo build config and builder (``_target_`` and
``_builder_`` in a saved config), from before the builder moved to :mod:`.model.builder`: kept so
that configs and checkpoints written then still resolve."""

from megatron_plugins.model.builder import MimoBuildConfig, MimoModelBuilder

__all__ = ["MimoBuildConfig", "MimoModelBuilder"]
