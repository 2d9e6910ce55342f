"""Energon sample types and sample loaders for the datasets ``tools.make_energon_dataset`` writes.

Training reads these datasets with Energon's decoder off, so media parts stay raw bytes until the
rank that needs them decodes them; the loaders here turn the text parts (``txt`` / ``json``) into
``str`` themselves, which Energon's ``field_map`` cannot do for undecoded parts. A dataset's
``.nv-meta/sample_loader.py`` imports one of them (see ``LOADERS``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from megatron.energon import Sample
from megatron.energon.edataclass import edataclass

from megatron_plugins.media.codec import BadSampleError, decode_text

__all__ = [
    "AUDIO_PART", "AudioTranscriptSample", "ConversationSample", "IMAGE_PARTS",
    "ImageAudioCaptionSample", "LOADERS", "conversation_part", "conversation_parts"
]

#: Tar part extensions an image may be stored under (the source file's own encoding is kept).
IMAGE_PARTS = ("jpg", "png")
#: Tar part extension of audio.
AUDIO_PART = "wav"


@edataclass
class AudioTranscriptSample(Sample):
    """Speech (or any sound) and the text it should be transcribed to."""

    #: The WAV file's bytes, undecoded.
    audio: bytes
    #: The transcript.
    transcript: str


@edataclass
class ImageAudioCaptionSample(Sample):
    """An image and a sound described together by one caption."""

    #: The image file's bytes (PNG or JPEG), undecoded.
    image: bytes
    #: The WAV file's bytes, undecoded.
    audio: bytes
    #: The caption naming what is seen and heard.
    caption: str


@edataclass
class ConversationSample(Sample):
    """A multi-turn conversation with 0..N images or videos, each at its ``<image>`` marker, in
    order.

    Stored as tar parts ``<key>.0.png``, ``<key>.1.jpg``, ... (:func:`conversation_part`), a
    video's frames as ``<key>.2.0.jpg``, ``<key>.2.1.jpg``, ..., and ``<key>.json``; a text-only
    sample has the ``json`` part alone.
    """

    #: The image files' bytes (PNG or JPEG), undecoded, in marker order (empty: text-only); a
    #: video is a list of its frames' files (at ``media.DEFAULT_VIDEO_FPS``) or a mapping
    #: ``{"frames": [...], "fps": number}``.
    images: list[bytes | list[bytes] | dict]
    #: The turns as JSON text: a list of ``{"role": "system"|"user"|"assistant", "content"}``,
    #: image ``i`` at the ``i``-th ``<image>`` marker (with no marker, all images at the start of
    #: the first user turn).
    conversation: str


def _text(raw: dict[str, Any], part: str) -> str:
    """A text part as ``str``, whether Energon's decoder already decoded it or not."""
    return decode_text(raw[part], raw["__key__"], part)


def _json(raw: dict[str, Any], part: str) -> dict:
    """A ``json`` part as a dict, whether Energon's decoder already parsed it or not."""
    if isinstance(raw[part], dict):
        return raw[part]
    try:
        return json.loads(_text(raw, part))
    except json.JSONDecodeError as error:
        raise BadSampleError(raw["__key__"], part, f"is not JSON ({error.msg})") from None


def _image(raw: dict[str, Any]) -> Any:
    """The sample's image part, whichever of the image extensions it was stored under."""
    return next(raw[part] for part in IMAGE_PARTS if part in raw)


def load_caption(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of Energon's ``CaptioningSample`` from an image part and a ``txt`` caption."""
    return dict(image=_image(raw), caption=_text(raw, "txt"))


def load_vqa(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of Energon's ``VQASample`` from an image part and a ``json`` {question, answer}."""
    qa = _json(raw, "json")
    return dict(image=_image(raw), context=qa["question"], answers=[qa["answer"]])


def load_transcript(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of ``AudioTranscriptSample`` from a ``wav`` part and a ``txt`` transcript."""
    return dict(audio=raw[AUDIO_PART], transcript=_text(raw, "txt"))


def load_image_audio_caption(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of ``ImageAudioCaptionSample`` from image, ``wav`` and ``txt`` parts."""
    return dict(image=_image(raw), audio=raw[AUDIO_PART], caption=_text(raw, "txt"))


_CONVERSATION_IMAGE = re.compile(rf"(\d+)\.(?:(\d+)\.)?({'|'.join(IMAGE_PARTS)})")
"""A conversation's image part: its index in marker order, a video frame's index, then the source
file's encoding."""


def conversation_part(index: int | str, extension: str) -> str:
    """The tar part of a conversation's ``index``-th image stored as ``extension`` (jpg, png);
    ``index`` ``"2.0"``: the first frame of its third item, a video."""
    return f"{index}.{extension}"


def conversation_parts(part: str) -> bool:
    """Energon's part filter of conversation datasets: the turns and every numbered image (and
    the single ``jpg`` / ``png`` part of datasets written before samples held several)."""
    return part == "json" or part in IMAGE_PARTS or bool(_CONVERSATION_IMAGE.fullmatch(part))


def _conversation_images(raw: dict[str, Any]) -> list[bytes]:
    """A conversation's images (a video: its frames, in frame order) in index order; the indices
    must run 0..N-1."""
    numbered: dict[int, Any] = {}
    for part, data in raw.items():
        match = _CONVERSATION_IMAGE.fullmatch(part)
        if not match:
            continue
        index, existing = int(match.group(1)), numbered.get(int(match.group(1)))
        if existing is not None and (match.group(2) is None or not isinstance(existing, dict)):
            raise BadSampleError(raw["__key__"], f"images[{index}]", "is stored as more than one "
                                 "image part, or as an image and video frames; keep one")
        if match.group(2) is None:
            numbered[index] = data
        else:
            numbered.setdefault(index, {})[int(match.group(2))] = data
    if sorted(numbered) != list(range(len(numbered))):
        raise BadSampleError(raw["__key__"], "images", f"has image parts numbered "
                             f"{sorted(numbered)}; they must run 0..N-1 (rewrite the dataset with "
                             "python -m tools.make_energon_dataset --kind conversation)")
    for index, frames in numbered.items():
        if isinstance(frames, dict):
            if sorted(frames) != list(range(len(frames))):
                raise BadSampleError(raw["__key__"], f"images[{index}]", f"has video frame "
                                     f"parts numbered {sorted(frames)}; they must run 0..N-1")
            numbered[index] = [frames[frame] for frame in sorted(frames)]
    legacy = [raw[part] for part in IMAGE_PARTS if part in raw]
    return legacy + [numbered[index] for index in sorted(numbered)]


def load_conversation(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of ``ConversationSample`` from numbered image parts and a ``json`` list of turns
    (kept as JSON text, re-serialized where Energon's decoder already parsed it)."""
    turns = raw["json"]
    text = json.dumps(turns) if isinstance(turns, (list, dict)) else _text(raw, "json")
    return dict(images=_conversation_images(raw), conversation=text)


#: The loader for each dataset kind of ``tools.make_energon_dataset``.
LOADERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "caption": load_caption,
    "vqa": load_vqa,
    "transcript": load_transcript,
    "image_audio_caption": load_image_audio_caption,
    "conversation": load_conversation,
}
