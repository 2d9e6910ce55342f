"""HF's Qwen2-VL image and video preprocessing, which Qwen2.5-VL's and Qwen3-VL's towers share.

Each image is resized to multiples of ``patch_size * spatial_merge_size`` within the processor's
pixel range (Qwen2-VL's ``smart_resize``), cut into patches with each 2x2 merge block contiguous;
a video (a :class:`~megatron_plugins.media.codec.Video`, an item of the same encoder) is resized
frame by frame as HF's video processor does, its frames paired by ``temporal_patch_size``; a
microbatch's items are packed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from megatron_plugins.encoders.base import MediaPreprocessor
from megatron_plugins.encoders.hf_vision import hf_normalized
from megatron_plugins.encoders.native_vit import MAX_ASPECT_RATIO, nearest_grid
from megatron_plugins.media.codec import Video

__all__ = ["DEFAULT_VIDEO_MAX_PIXELS", "DEFAULT_VIDEO_MIN_PIXELS", "QwenImagePreprocessor",
           "qwen_smart_resize"]

DEFAULT_VIDEO_MIN_PIXELS = 128 * 28 * 28
DEFAULT_VIDEO_MAX_PIXELS = 28 * 28 * 768
"""Qwen2-VL's video processor's per-frame pixel range when its config gives none."""


def qwen_smart_resize(height: int, width: int, factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """HF Qwen2-VL's ``smart_resize``, rounding for rounding; ValueError (naming the image) for an
    aspect ratio above 200 or a size whose grid lies above ``max_pixels``."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image {height}x{width} (height x width): aspect ratio above "
                         f"{MAX_ASPECT_RATIO}; crop or drop such images")
    h_bar, w_bar = nearest_grid(height, width, factor, min_pixels, max_pixels)
    if h_bar * w_bar > max_pixels:
        raise ValueError(f"image {height}x{width} (height x width): its {factor}-pixel grid "
                         f"{h_bar}x{w_bar} is above max_pixels {max_pixels}; crop such images")
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenImagePreprocessor(MediaPreprocessor):
    """HF's ``Qwen2VLImageProcessor`` (PIL) for one still image: resize to
    :func:`qwen_smart_resize`, rescale, normalize, repeat over ``temporal_patch_size`` frames,
    flatten patches with each ``merge_size`` x ``merge_size`` block contiguous; HF's
    ``Qwen2VLVideoProcessor`` for a :class:`Video` (torch's antialiased bicubic resize within the
    video pixel range, the last frame repeated up to a multiple of ``temporal_patch_size``); a
    microbatch's items are packed."""

    media: ClassVar[str] = "image"
    takes_video: ClassVar[bool] = True
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    video_min_pixels: int = DEFAULT_VIDEO_MIN_PIXELS
    video_max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS

    def grid(self, height: int, width: int, video: bool = False) -> tuple[int, int]:
        """The patch grid (rows, columns) of a ``height`` x ``width`` image (or video frame)."""
        pixels = ((self.video_min_pixels, self.video_max_pixels) if video
                  else (self.min_pixels, self.max_pixels))
        new_height, new_width = qwen_smart_resize(height, width, self.patch_size * self.merge_size,
                                                  *pixels)
        return new_height // self.patch_size, new_width // self.patch_size

    def item_grid(self, size: tuple[int | float, ...]) -> tuple[int, int, int]:
        """(temporal, rows, columns) patches of an item of this
        :func:`~megatron_plugins.media.codec.media_size`: ``(height, width)`` or a video's
        ``(frames, height, width, fps)``."""
        if len(size) == 2:
            return (1, *self.grid(int(size[0]), int(size[1])))
        frames = int(size[0])
        return (-(-frames // self.temporal_patch_size),
                *self.grid(int(size[1]), int(size[2]), video=True))

    def _video(self, video: Video) -> dict[str, torch.Tensor]:
        """As HF's ``Qwen2VLVideoProcessor`` (``pixel_values_videos`` / ``video_grid_thw``)."""
        frames = video.frames
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"video frames {frames.dtype} {list(frames.shape)}: expected uint8 "
                             "[frames, height, width, 3]")
        _, rows, columns = self.item_grid(frames.shape[:3] + (video.fps,))
        p, m, span = self.patch_size, self.merge_size, self.temporal_patch_size
        pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
        if (rows * p, columns * p) != tuple(pixels.shape[-2:]):
            # torchvision's uint8 bicubic resize on CPU, which HF's video processor calls.
            pixels = F.interpolate(pixels, size=(rows * p, columns * p), mode="bicubic",
                                   align_corners=False, antialias=True)
        scale = 1.0 / self.rescale_factor
        mean = (torch.tensor(self.mean) * scale)[:, None, None]
        std = (torch.tensor(self.std) * scale)[:, None, None]
        pixels = (pixels.to(torch.float32) - mean) / std
        if pad := -len(pixels) % span:
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
        steps = len(pixels) // span
        # (step, block row, block column, row in block, column in block, channel, frame, y, x).
        patches = pixels.reshape(steps, span, 3, rows // m, m, p, columns // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return {"pixel_values": patches.reshape(steps * rows * columns,
                                                3 * span * p * p).contiguous(),
                "grid_thw": torch.tensor([steps, rows, columns], dtype=torch.int64)}

    def __call__(self, media: np.ndarray | Video) -> dict[str, torch.Tensor]:
        """uint8 ``[H, W, 3]`` -> ``{"pixel_values": float32 [rows * columns, 3 * T * p * p],
        "grid_thw": int64 [3] (1, rows, columns)}``, as HF's ``pixel_values`` /
        ``image_grid_thw``; a :class:`Video` -> its ``[steps * rows * columns, ...]`` patches
        and ``(steps, rows, columns)``."""
        if isinstance(media, Video):
            return self._video(media)
        rows, columns = self.grid(*media.shape[:2])
        p, m, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        image = Image.fromarray(media).resize((columns * p, rows * p),
                                              resample=Image.Resampling(self.resample))
        pixels = torch.from_numpy(hf_normalized(np.asarray(image), self.rescale_factor, self.mean,
                                                self.std)).permute(2, 0, 1)
        # (block row, block column, row in block, column in block, channel, y, x), as HF.
        patches = pixels.reshape(3, rows // m, m, p, columns // m, m, p)
        patches = patches.permute(1, 4, 2, 5, 0, 3, 6)
        patches = patches.unsqueeze(5).expand(*patches.shape[:5], frames, p, p)
        return {"pixel_values": patches.reshape(rows * columns, 3 * frames * p * p).contiguous(),
                "grid_thw": torch.tensor([1, rows, columns], dtype=torch.int64)}

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``{"pixel_values": [total patches, 3 * T * p * p], "grid_thw": [items, 3]}``."""
        return {"pixel_values": torch.cat([item["pixel_values"] for item in items]),
                "grid_thw": torch.stack([item["grid_thw"] for item in items])}
