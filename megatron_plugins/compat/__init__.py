"""Bridges over gaps in the released megatron-core 0.19.2 wheel, one module per area.

A *gap* is a place where the stock wheel fails or costs needlessly in our runs; a *bridge* is the
smallest change that closes it, applied explicitly by the code path that needs it (importing
this package or any of its modules applies nothing); a *canary* is the unit test that exercises
the stock behaviour behind the gap and fails once a release closes it, so the bridge is noticed
and removed. :data:`GAPS` indexes them. Callers import the area they need, e.g.
``from megatron_plugins.compat import model_build``.
"""

from __future__ import annotations

import dataclasses


class MegatronCompatError(RuntimeError):
    """A bridge found the installed wheel, or a runtime invariant the bridge relies on (a static
    transfer shape, a settled rerun flag, an always-succeeding optimizer step), not as it expects."""


@dataclasses.dataclass(frozen=True)
class Gap:
    """One gap: what it is, which area module bridges it, which of our functions applies the
    bridge, and the canary test that fails once the wheel closes it."""

    id: str
    summary: str
    area: str
    installed_by: str
    canary: str


def _canary(area: str, test: str) -> str:
    return f"tests/unit_tests/compat/test_{area}.py::{test}"


GAPS: tuple[Gap, ...] = (
    Gap("1", "pretrain() compiles dataset helpers with make, but the wheel ships no Makefile",
        "startup", "launch.train", _canary("startup", "test_gap1_canary_wheel_ships_prebuilt_helpers_but_no_makefile")),
)
