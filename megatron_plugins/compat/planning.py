"""Bridge for planning a GPU command line on a machine without Transformer Engine (Gap 34).

``mimo-plan --gpu`` / ``--advise`` run the launch's own parse, stock validation and the language
config's checks on a login node or a laptop, for the GPUs the command will run on. Stock asks the
machine it runs on for Transformer Engine while it checks the flags: its version
(``megatron.core.utils.get_te_version``, 0.0.0 without it) and the fused kernels it probes for
(fused RoPE, fused MoE permutation). Without it a plain GPU command line (stock's RoPE fusion is on
by default) fails there. While planning, those probes answer as on a GPU machine with a current
Transformer Engine; nothing runs a kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_plugins.compat import MegatronCompatError, record

__all__ = ["PLANNED_TE_VERSION", "transformer_engine_assumed"]

PLANNED_TE_VERSION = "2.14.0"
"""The Transformer Engine a plan assumes: the newest release megatron-core 0.19.2's checks ask
for."""

_PROBED = (
    ("megatron.core.models.common.embeddings.rope_utils",
     ("fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd")),
    ("megatron.core.transformer.moe.moe_utils",
     ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
      "fused_sort_chunks_by_index_with_probs", "fused_unpermute")),
)
"""(module, the Transformer Engine kernels it holds, None without it) that stock's config
checks probe for."""


def _planning_only(*_args: object, **_kwargs: object) -> None:
    """What a probed kernel is while planning: present, never run."""
    raise MegatronCompatError("a Transformer Engine kernel was called while planning, where "
                              "only its presence is assumed")


@contextlib.contextmanager
def transformer_engine_assumed() -> Iterator[None]:
    """Inside the block stock's checks see a Transformer Engine (Gap 34); on exit the machine's
    own answers are back. Changes nothing where Transformer Engine is installed.

    Gap 34 (stock's flag checks ask this machine for Transformer Engine): ``TransformerConfig.
    __post_init__`` refuses ``apply_rope_fusion`` (on by default for RoPE) when ``rope_utils``'
    fused kernels are None and ``moe_permute_fusion`` when ``moe_utils``' are, and compares
    ``is_te_min_version`` (through ``megatron.core.utils``' cached ``_te_version``) for fp8 MoE,
    recomputation and overlap flags, as ``validate_args`` does for others. The cached version is
    set to :data:`PLANNED_TE_VERSION` and each absent kernel to a stand-in, then restored.
    """
    import importlib

    from megatron.core import utils
    from packaging.version import Version

    if utils.get_te_version() != Version("0.0.0"):
        yield
        return
    replaced: list[tuple[object, str, object]] = [(utils, "_te_version", utils._te_version)]
    for name, kernels in _PROBED:
        module = importlib.import_module(name)
        replaced += [(module, kernel, None) for kernel in kernels
                     if getattr(module, kernel, None) is None]
    utils._te_version = Version(PLANNED_TE_VERSION)
    for module, attr, _ in replaced[1:]:
        setattr(module, attr, _planning_only)
    record("34")
    try:
        yield
    finally:
        for module, attr, value in replaced:
            setattr(module, attr, value)
