"""Encoder replica imbalance before and after ``--balance-encoder-work``, on a realistic image mix.

    python benchmarks/encoder_balance.py                 # 1000 global microbatches, g = 2, 4, 8
    python benchmarks/encoder_balance.py --microbatches 100

No model runs: a replica's work is :func:`megatron_plugins.data.balance.sample_work` (per image
``tokens^2 + tokens``), its token counts from the native-resolution vit's own ``item_tokens``
(``--vit-native-resolution``, patch 14, at most 1024*14*14 pixels: up to 1024 tokens per image,
Qwen2-VL's budget without its 2x2 merge; at least 4*14*14). Samples hold 0..3 images (15% text
only, 60% one, 15% two, 10% three), each a photo of the native-resolution benchmark's mix (70%),
a thumbnail (20%) or a panorama (10%). A fan-in group of ``g`` encoder replicas fills one
language replica of ``4 g`` samples (4 per replica); "before" is the fixed slice by position,
"after" the balanced assignment. Figures: the mean over microbatches of max/mean replica work,
its 95th percentile, and sum(max)/sum(mean), what the step waits for on average.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.native_resolution import PHOTOS  # noqa: E402
from megatron_plugins.data.balance import assign_samples, sample_work  # noqa: E402

THUMBNAILS = [(64, 64), (96, 128), (128, 96), (150, 150), (120, 160), (200, 150), (100, 100)]
PANORAMAS = [(800, 4000), (1000, 6000), (600, 3600), (4000, 1000), (720, 5120)]
KINDS = ((PHOTOS, 70), (THUMBNAILS, 20), (PANORAMAS, 10))
IMAGES_PER_SAMPLE = ((0, 15), (1, 60), (2, 15), (3, 10))
SAMPLES_PER_REPLICA = 4


def _vit_item_tokens():
    """The native vit's ``item_tokens`` at patch 14, 4*14*14 .. 1024*14*14 pixels."""
    from megatron_plugins.encoders.vit import ViTEncoder
    from megatron_plugins.parallel.layout import ModulePlacement

    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    args = parser.parse_args(["--vit-native-resolution", "--vit-patch-size", "14",
                              "--vit-min-pixels", str(4 * 14 * 14),
                              "--vit-max-pixels", str(1024 * 14 * 14)])
    placement = ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0,
                                provider="vit")
    return ViTEncoder("vision", args, placement).item_tokens


def _sample(rng: random.Random, item_tokens) -> tuple[int, ...]:
    counts, weights = zip(*IMAGES_PER_SAMPLE)
    kinds, kind_weights = zip(*KINDS)
    return tuple(item_tokens(rng.choice(rng.choices(kinds, kind_weights)[0]))
                 for _ in range(rng.choices(counts, weights)[0]))


def _imbalance(group: list[tuple[int, ...]], assigned: list[list[int]]) -> tuple[int, float]:
    """The busiest replica's work and the mean replica work."""
    loads = [sum(sample_work(group[i]) for i in samples) for samples in assigned]
    return max(loads), sum(loads) / len(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    item_tokens = _vit_item_tokens()
    print(f"{'g':>3} {'samples':>7}  {'max/mean before':>15} {'after':>6}  "
          f"{'p95 before':>10} {'after':>6}  {'sum max/sum mean before':>23} {'after':>6}")
    for replicas in (2, 4, 8):
        rng = random.Random(options.seed)
        samples = SAMPLES_PER_REPLICA * replicas
        figures: dict[str, list[tuple[int, float]]] = {"before": [], "after": []}
        for _ in range(options.microbatches):
            group = [_sample(rng, item_tokens) for _ in range(samples)]
            fixed = [list(range(r * SAMPLES_PER_REPLICA, (r + 1) * SAMPLES_PER_REPLICA))
                     for r in range(replicas)]
            figures["before"].append(_imbalance(group, fixed))
            figures["after"].append(_imbalance(group, assign_samples(group, replicas)))
        row = []
        for stat in ("mean", "p95", "aggregate"):
            for when in ("before", "after"):
                ratios = sorted(top / mean for top, mean in figures[when] if mean)
                if stat == "mean":
                    row.append(sum(ratios) / len(ratios))
                elif stat == "p95":
                    row.append(ratios[int(0.95 * (len(ratios) - 1))])
                else:
                    row.append(sum(t for t, _ in figures[when]) / sum(m for _, m in figures[when]))
        print(f"{replicas:>3} {samples:>7}  {row[0]:>15.3f} {row[1]:>6.3f}  {row[2]:>10.3f} "
              f"{row[3]:>6.3f}  {row[4]:>23.3f} {row[5]:>6.3f}")


if __name__ == "__main__":
    main()
