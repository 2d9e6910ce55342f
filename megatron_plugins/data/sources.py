"""Which data a run reads: the mock by default, Energon when stock ``--data-path`` is given."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from megatron_plugins.data.audio_in_video import AudioInVideo
from megatron_plugins.data.mock import MockSource, max_encoder_tokens
from megatron_plugins.data.streams import DataSource
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import DataFlagError
from megatron_plugins.media.mock import MOCK_VIDEO_FPS

__all__ = ["add_data_args", "audio_in_video", "build_source"]


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """The data flags of our own (stock ``--data-path``, ``--num-workers``, tokenizer flags and
    ``--seed`` keep their stock meaning)."""
    group = parser.add_argument_group("megatron-plugins data")
    group.add_argument("--no-data-alignment-check", dest="data_alignment_check",
                       action="store_false",
                       help="Do not check, each step, that every encoder replica embedded the "
                            "samples its language replica holds (on by default; it adds no "
                            "collective).")
    group.add_argument("--mock-items-per-sample", default="0:2", metavar="MIN:MAX",
                       help="Mock data only: each sample holds MIN to MAX items (images, clips) "
                            "per encoder, drawn uniformly (0: a text-only sample for that "
                            "encoder); one number N for exactly N. Default 0:2.")
    group.add_argument("--mock-video-frames", type=int, default=0, metavar="N",
                       help="Mock data only: for encoders that take videos (qwen2_5_vl), each "
                            "item is, one time in two, a video of N frames (at "
                            "--mock-video-fps) instead of an image. Default 0 (images only).")
    group.add_argument("--mock-video-fps", type=float, default=MOCK_VIDEO_FPS, metavar="FPS",
                       help="Mock data only: the frame rate of --mock-video-frames' videos, "
                            "which sets their temporal positions (Qwen3-Omni: 13 a second, "
                            f"fractional at most rates). Default {MOCK_VIDEO_FPS:g}.")
    group.add_argument("--balance-encoder-work", action="store_true",
                       help="Where an encoder has more DP replicas than the language model, let "
                            "the replicas that fill one language replica share its samples by "
                            "work (sum over items of tokens^2 + tokens, largest first onto the "
                            "least-loaded replica) instead of in fixed slices; the language puts "
                            "the received rows back in sample order. Encoders with as many DP "
                            "replicas as the language or fewer have nothing to balance.")
    group.add_argument("--use-audio-in-video", action="store_true",
                       help="Feed each video's sound track to the audio encoder too, its tokens "
                            "interleaved with the video's by time as the --hf-model checkpoint "
                            "does (Qwen2.5-Omni: 2-second chunks, each chunk's video tokens "
                            "then its sound's; Qwen3-Omni: token by token by time); every "
                            "video must have a sound track. Needs "
                            "--data-path and such a --hf-model.")
    group.add_argument("--pack-sequences", action="store_true",
                       help="Pack each language microbatch's --micro-batch-size samples into "
                            "one --seq-length row, end to end, each with its own positions and "
                            "attending only to itself (THD: Transformer Engine's attention, or "
                            "the reference packed attention with --transformer-impl local); the "
                            "later samples' text is cut when they do not fit.")


def _items_per_sample(text: str) -> tuple[int, int]:
    """``--mock-items-per-sample``'s ``MIN:MAX`` (or ``N``)."""
    fewest, _, most = text.partition(":")
    try:
        bounds = (int(fewest), int(most or fewest))
    except ValueError:
        bounds = (-1, -1)
    if not 0 <= bounds[0] <= bounds[1] or bounds[1] == 0:
        raise DataFlagError(f"--mock-items-per-sample {text}: give MIN:MAX with 0 <= MIN <= MAX "
                            "and MAX >= 1 (or one number N >= 1), e.g. 0:2")
    return bounds


def _checkpoint_wrapping(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """``--hf-model``'s ids around each item's run (Qwen's ``<|vision_start|>`` /
    ``<|vision_end|>``), for the mock to put them where the checkpoint's processor does."""
    from megatron_plugins.weights.flags import checkpoint_item_wrapping

    return checkpoint_item_wrapping(args)


def _checkpoint_placeholders(args: argparse.Namespace) -> dict[str, int]:
    """``--hf-model``'s encoders and their checkpoint's tokens: the mock marks each encoder's
    positions with its own, so the checkpoint's language model reads features where HF does."""
    from megatron_plugins.weights.flags import checkpoint_image_token

    return checkpoint_image_token(args)


def audio_in_video(args: argparse.Namespace) -> AudioInVideo | None:
    """``--use-audio-in-video``'s encoders and chunks, checked before any process group."""
    if not getattr(args, "use_audio_in_video", False):
        return None
    from megatron_plugins.weights.flags import checkpoint_audio_in_video

    if not args.data_path:
        raise DataFlagError("--use-audio-in-video needs --data-path: the mock data's videos "
                            "have no sound track")
    found = checkpoint_audio_in_video(args)
    if found is None:
        given = (f"--hf-model {args.hf_model} does not" if getattr(args, "hf_model", None)
                 else "no --hf-model is given, so no checkpoint does")
        raise DataFlagError("--use-audio-in-video interleaves each video's sound with its "
                            "frames as the checkpoint's family does (Qwen2.5-Omni, Qwen3-Omni); "
                            f"{given}; drop the flag or give such a folder")
    return AudioInVideo(*found)


def _mock_video_fps(args: argparse.Namespace) -> float:
    """``--mock-video-fps``, positive."""
    fps = getattr(args, "mock_video_fps", MOCK_VIDEO_FPS)
    if not fps > 0:
        raise DataFlagError(f"--mock-video-fps {fps:g}: give a positive frame rate")
    return fps


def build_source(args: argparse.Namespace, plugins: Mapping[str, EncoderPlugin]) -> DataSource:
    """The run's data: Energon when stock ``--data-path`` names a dataset, else the mock. Checks
    everything that can be checked before any process group (paths, splits, tokenizer)."""
    items = (1, 1) if args.data_path else _items_per_sample(args.mock_items_per_sample)
    frames = 0 if args.data_path else getattr(args, "mock_video_frames", 0)
    if frames < 0:
        raise DataFlagError(f"--mock-video-frames {frames}: give 0 (images only) or a number of "
                            "frames >= 1")
    wrapping = _checkpoint_wrapping(args)
    encoder_tokens = (max_encoder_tokens(list(plugins.values()), items[1], frames)
                      + 2 * items[1] * len(wrapping))
    if encoder_tokens + 2 > args.seq_length:
        per = (f"{items[1]} items per encoder (--mock-items-per-sample "
               f"{args.mock_items_per_sample})" if items[1] > 1 else "one item per encoder")
        raise DataFlagError(
            f"--seq-length {args.seq_length} leaves no room for text: with {per} the encoders "
            f"fill up to {encoder_tokens} positions per sample; raise --seq-length above "
            f"{encoder_tokens + 1}")
    sounds = audio_in_video(args)
    if not args.data_path:
        return MockSource(seed=args.seed, seq_length=args.seq_length,
                          vocab_size=args.vocab_size, plugins=dict(plugins),
                          items_per_sample=items,
                          mrope=args.position_embedding_type == "mrope",
                          placeholder_ids=_checkpoint_placeholders(args), wrapping=wrapping,
                          video_frames=frames, video_fps=_mock_video_fps(args))
    if len(args.data_path) != 1:
        raise DataFlagError(
            f"--data-path takes one Energon dataset (a prepared folder, or a metadataset YAML "
            f"that blends several); got {len(args.data_path)} values")
    from megatron_plugins.data.energon.loader import open_source

    return open_source(Path(args.data_path[0]), args, dict(plugins), sounds)
