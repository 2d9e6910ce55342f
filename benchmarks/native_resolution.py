"""The vit encoder's step time at fixed size against native resolution, on the same photos.

    python benchmarks/native_resolution.py            # ViT-Ti/16 shapes, 24 photos, 5 rounds
    python benchmarks/native_resolution.py --smoke    # tiny, seconds

One rank on the CPU simulation, one torch thread, fp32, the encoder alone (no projection, no
language model): forward + backward of microbatches of ``--micro-batch-size`` images, the images
already preprocessed (decode and resize are the data loader's, not the step's). Modes:

- fixed: today's CLIP recipe, shorter side resized to 224 and center-cropped (196 patches each);
- native, same budget: ``--vit-native-resolution --vit-max-pixels 224*224`` (at most 196 patches,
  aspect ratio kept, nothing cropped);
- native, 2x budget: ``--vit-max-pixels 2*224*224``.

The photos are random pixels at sizes of a typical mix (COCO-like 4:3 and 3:4, 16:9 video
frames, phone portraits, squares, a panorama, small thumbnails). Each round times every mode once,
in mirrored order across rounds so load from other jobs hits all modes alike; a figure is the
median over rounds. The machine's load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHOTOS = [(480, 640), (640, 480), (427, 640), (375, 500), (768, 1024), (720, 1280),
          (1080, 1920), (1280, 720), (1920, 1080), (800, 800), (1536, 2048), (400, 300),
          (400, 1200), (224, 224), (150, 200), (333, 500), (612, 612), (640, 360),
          (3024, 4032), (4032, 3024), (500, 281), (256, 320), (960, 720), (1000, 750)]
"""(height, width) of the benchmark's photos."""

SHAPES = {
    "default": ["--vit-num-layers", "12", "--vit-hidden-size", "192",
                "--vit-num-attention-heads", "3", "--vit-patch-size", "16"],
    "smoke": ["--vit-num-layers", "1", "--vit-hidden-size", "32",
              "--vit-num-attention-heads", "2", "--vit-patch-size", "16"],
}
"""Encoder flags: ViT-Ti/16's shape (5.5M parameters) or a tiny one."""

MODES = {
    "fixed 224": ["--vit-img-size", "224"],
    "native <= 224^2 px": ["--vit-native-resolution", "--vit-min-pixels", str(16 * 16 * 4),
                           "--vit-max-pixels", str(224 * 224)],
    "native <= 2*224^2 px": ["--vit-native-resolution", "--vit-min-pixels", str(16 * 16 * 4),
                             "--vit-max-pixels", str(2 * 224 * 224)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny encoder, one round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    options = parser.parse_args()
    rounds = 1 if options.smoke else options.rounds
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugins.encoders.vit import ViTEncoder
    from megatron_plugins.parallel.layout import ModulePlacement
    from tests.models.hf_vision import language_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    groups = ProcessGroupCollection.use_mpu_process_groups()
    grid = ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="vit")
    rng = np.random.default_rng(0)
    photos = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in PHOTOS]
    size = options.micro_batch_size

    flag_parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(flag_parser)
    runs = {}
    for mode, flags in MODES.items():
        encoder = ViTEncoder("vision", flag_parser.parse_args(
            SHAPES["smoke" if options.smoke else "default"] + flags), grid)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        network = build_module(encoder.encoder_spec(encoder.transformer_config(language_config()),
                                                    groups))
        preprocessor = encoder.preprocessor()
        items = [preprocessor(photo) for photo in photos]
        batches = [preprocessor.collate(items[i:i + size]) for i in range(0, len(items), size)]
        tokens = [encoder.item_tokens(photo.shape[:2]) for photo in photos]
        runs[mode] = (network, batches, tokens)

    def step(mode: str) -> float:
        network, batches, _ = runs[mode]
        start = time.perf_counter()
        for batch in batches:
            network(**batch).square().mean().backward()
        network.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for mode in MODES:
        step(mode)  # warm-up: allocator, first-call paths
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
        for mode in order:
            times[mode].append(step(mode))
    params = sum(p.numel() for p in runs["fixed 224"][0].parameters())
    print(f"vit encoder, {params / 1e6:.2f}M parameters, fp32, 1 thread, {len(PHOTOS)} photos in "
          f"microbatches of {size}, forward + backward; median of {rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'mode':22s} {'images/s':>9s} {'tokens/image mean':>18s} {'max':>5s} "
          f"{'ms/microbatch':>13s}")
    for mode, (_, _, tokens) in runs.items():
        seconds = statistics.median(times[mode])
        print(f"{mode:22s} {len(PHOTOS) / seconds:9.1f} {statistics.mean(tokens):18.1f} "
              f"{max(tokens):5d} {1000 * seconds / len(runs[mode][1]):13.1f}")


if __name__ == "__main__":
    main()
