"""The timeline as a picture: one lane per rank, grouped by module, a colour per phase kind.

Lanes follow the layout: each module's ranks in order (a rank hosting an encoder has a lane in
the encoder's group too), labelled with the rank and its pipeline stage. Each step is a light
band across its lane; compute phases sit on it in the module's blues or greens, waits on another
grid or stage in orange (send) and red (receive), so a grid that waits shows red where the other
grid computes. Time runs left to right, from the first recorded phase.
"""

from __future__ import annotations

from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont

from megatron_plugins.parallel.layout import ParallelLayout
from megatron_plugins.performance.recorder import Phase
from megatron_plugins.step.phases import PHASE_KINDS, STEP

__all__ = ["COLOURS", "draw", "lanes", "picture_size"]

COLOURS = {
    "encoder-forward": (76, 114, 176), "encoder-backward": (31, 59, 115),
    "language-forward": (85, 168, 104), "language-backward": (45, 106, 62),
    "send-wait": (240, 160, 75), "recv-wait": (196, 78, 82),
    "colocated-routing": (129, 114, 178), "grad-reduce": (147, 120, 96),
    "optimizer": (218, 139, 195), STEP: (229, 229, 229),
}
"""Fill colour of each phase kind."""

WIDTH = 1200
LABEL = 170
"""Left margin holding the lane labels."""
RIGHT = 20
TOP = 48
"""Title and time axis."""
LANE = 22
GROUP_GAP = 10
LEGEND = 56
"""Two rows of legend at the bottom."""


def lanes(layout: ParallelLayout) -> list[tuple[str, int, int]]:
    """(module, rank, pipeline stage) of every lane, grouped by module in layout order."""
    return [(module.name, rank, module.coordinates(rank)["pp"])
            for module in layout.modules for rank in module.ranks]


def picture_size(layout: ParallelLayout) -> tuple[int, int]:
    """The picture's (width, height) for ``layout``: a lane per (module, rank)."""
    groups = len(layout.modules)
    return WIDTH, TOP + len(lanes(layout)) * LANE + (groups - 1) * GROUP_GAP + LEGEND


def _tick(span: float) -> float:
    """A round tick interval giving 4 to 10 ticks over ``span`` seconds."""
    step = 1e-6
    while span / step > 10:
        for factor in (2, 2.5, 2):
            step *= factor
            if span / step <= 10:
                break
    return step


def _label(seconds: float, unit: float) -> str:
    """``seconds`` in ms when ``unit`` (the tick) is under a second, else in s."""
    return f"{seconds * 1e3:.4g} ms" if unit < 1 else f"{seconds:.4g} s"


def draw(phases: Sequence[Phase], layout: ParallelLayout, title: str) -> Image.Image:
    """The picture of ``phases`` (any ranks' and steps') on ``layout``'s lanes."""
    width, height = picture_size(layout)
    image = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=12)
    start = min((p.start for p in phases), default=0.0)
    span = max((p.end for p in phases), default=start + 1.0) - start or 1.0
    scale = (width - LABEL - RIGHT) / span

    def x(at: float) -> float:
        return LABEL + (at - start) * scale

    tick = _tick(span)
    pen.text((8, 6), f"MiMo step timeline, {title} ({_label(span, span)})", fill="black",
             font=font)
    for index in range(int(span / tick) + 1):
        at = x(start + index * tick)
        pen.line([(at, TOP - 8), (at, height - LEGEND)], fill=(235, 235, 235))
        pen.text((at + 2, TOP - 20), _label(index * tick, tick), fill=(90, 90, 90), font=font)
    rows: dict[tuple[str, int], int] = {}
    top, previous = TOP, None
    for module, rank, stage in lanes(layout):
        if previous is not None and module != previous:
            top += GROUP_GAP
        rows[module, rank] = top
        pen.text((8, top + 4), f"{module} rank {rank} stage {stage}", fill="black", font=font)
        previous, top = module, top + LANE
    order = {kind: index for index, kind in enumerate(PHASE_KINDS)}
    for phase in sorted(phases, key=lambda p: (p.kind != STEP, order.get(p.kind, 0))):
        row = rows.get((phase.module, phase.rank))
        if row is None:
            continue
        inset = 2 if phase.kind == STEP else 5
        pen.rectangle([x(phase.start), row + inset, max(x(phase.end), x(phase.start) + 1),
                       row + LANE - inset], fill=COLOURS.get(phase.kind, (0, 0, 0)))
    left, line = 8, height - LEGEND + 10
    for kind in PHASE_KINDS:
        if left > width - 150:
            left, line = 8, line + 20
        pen.rectangle([left, line, left + 14, line + 12], fill=COLOURS[kind], outline="black")
        pen.text((left + 18, line), kind, fill="black", font=font)
        left += 150
    return image
