"""The sample schema: which Energon sample types training reads, the fields of each (media, loss
target, prompt), and the sample loaders of the datasets ``tools.make_energon_dataset`` writes.

One table (:data:`DATASET_KINDS`, by ``--kind``; :data:`SAMPLE_KINDS`, by sample class) serves
both the tool that writes datasets and the loader that reads them
(:mod:`megatron_plugins.data.energon`). Training reads datasets with Energon's decoder off, so media
parts stay raw bytes until the rank that needs them decodes them; the loaders here turn the text
parts (``txt`` / ``json``) into ``str`` themselves, which Energon's ``field_map`` cannot do for
undecoded parts. A dataset's ``.nv-meta/sample_loader.py`` imports one of them by name
(``load_caption``, ...), so those names stay.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection
from typing import Any, Callable

from megatron.energon import CaptioningSample, Sample, VQASample
from megatron.energon.edataclass import edataclass

from megatron_plugins.data.text import ROLES, Conversation, SampleText
from megatron_plugins.media.codec import BadSampleError, decode_text
from megatron_plugins.media.video import VIDEO_CONTAINERS

__all__ = [
    "AUDIO_PARTS", "AudioTranscriptSample", "ConversationKind", "ConversationSample",
    "DATASET_KINDS", "IMAGE_PARTS", "ImageAudioCaptionSample", "MEDIA_PARTS", "SAMPLE_KINDS",
    "SampleKind", "conversation_part", "conversation_parts", "sample_kind"
]

#: Tar part extensions an image may be stored under (the source file's own encoding is kept).
IMAGE_PARTS = ("jpg", "png")
#: Tar part extensions audio may be stored under (the source file's own encoding is kept).
AUDIO_PARTS = ("wav", "flac", "mp3")
#: Each media kind's tar part extensions.
MEDIA_PARTS = {"image": IMAGE_PARTS, "audio": AUDIO_PARTS}


@edataclass
class AudioTranscriptSample(Sample):
    """Speech (or any sound) and the text it should be transcribed to."""

    #: The audio file's bytes (WAV, FLAC or MP3), undecoded.
    audio: bytes
    #: The transcript.
    transcript: str


@edataclass
class ImageAudioCaptionSample(Sample):
    """An image and a sound described together by one caption."""

    #: The image file's bytes (PNG or JPEG), undecoded.
    image: bytes
    #: The audio file's bytes (WAV, FLAC or MP3), undecoded.
    audio: bytes
    #: The caption naming what is seen and heard.
    caption: str


@edataclass
class ConversationSample(Sample):
    """A multi-turn conversation with 0..N images or videos, each at its ``<image>`` marker, and
    0..N audio clips, each at its ``<audio>`` marker, in order.

    Stored as tar parts ``<key>.0.png``, ``<key>.1.jpg``, ... (:func:`conversation_part`), a
    video's frames as ``<key>.2.0.jpg``, ``<key>.2.1.jpg``, ..., a video file as
    ``<key>.3.mp4`` (any of ``media.video.VIDEO_CONTAINERS``), clips as ``<key>.0.wav``,
    ``<key>.1.mp3``, ... (numbered apart from the images), and ``<key>.json``; a text-only sample
    has the ``json`` part alone.
    """

    #: The image files' bytes (PNG or JPEG), undecoded, in marker order (empty: text-only); a
    #: video is a list of its frames' files (at ``media.DEFAULT_VIDEO_FPS``), a mapping
    #: ``{"frames": [...], "fps": number}``, or a file ``{"file": bytes, "container": "mp4"}``.
    images: list[bytes | list[bytes] | dict]
    #: The turns as JSON text: a list of ``{"role": "system"|"user"|"assistant", "content"}``,
    #: image ``i`` at the ``i``-th ``<image>`` marker (with no marker, all images at the start of
    #: the first user turn).
    conversation: str
    #: The audio files' bytes (WAV, FLAC or MP3), undecoded, in ``<audio>`` marker order (empty:
    #: none; a default, so a ``field_map`` without audio still fills the sample).
    audios: list[bytes] = dataclasses.field(default_factory=list)


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


def _part(raw: dict[str, Any], media: str) -> Any:
    """The sample's ``media`` part, whichever of that kind's extensions it was stored under."""
    return next(raw[part] for part in MEDIA_PARTS[media] if part in raw)


def load_caption(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of Energon's ``CaptioningSample`` from an image part and a ``txt`` caption."""
    return dict(image=_part(raw, "image"), caption=_text(raw, "txt"))


def load_vqa(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of Energon's ``VQASample`` from an image part and a ``json`` {question, answer}."""
    qa = _json(raw, "json")
    return dict(image=_part(raw, "image"), context=qa["question"], answers=[qa["answer"]])


def load_transcript(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of ``AudioTranscriptSample`` from an audio part and a ``txt`` transcript."""
    return dict(audio=_part(raw, "audio"), transcript=_text(raw, "txt"))


def load_image_audio_caption(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of ``ImageAudioCaptionSample`` from image, audio and ``txt`` parts."""
    return dict(image=_part(raw, "image"), audio=_part(raw, "audio"), caption=_text(raw, "txt"))


_CONVERSATION_PARTS = {media: re.compile(rf"(\d+)\.(?:(\d+)\.)?({'|'.join(parts)})")
                       for media, parts in MEDIA_PARTS.items()}
"""A conversation's item part of each media kind: its index in marker order, a video frame's
index, then the source file's encoding."""

_VIDEO_FILE_PART = re.compile(rf"(\d+)\.({'|'.join(VIDEO_CONTAINERS)})")
"""A conversation's video file part (an item of the image kind): its index, then its container."""


def conversation_part(index: int | str, extension: str) -> str:
    """The tar part of a conversation's ``index``-th item of a kind stored as ``extension`` (jpg,
    png; wav, flac, mp3); ``index`` ``"2.0"``: the first frame of its third item, a video."""
    return f"{index}.{extension}"


def conversation_parts(part: str) -> bool:
    """Energon's part filter of conversation datasets: the turns and every numbered item (and
    the single ``jpg`` / ``png`` part of datasets written before samples held several)."""
    return part == "json" or part in IMAGE_PARTS or bool(_VIDEO_FILE_PART.fullmatch(part)) or any(
        pattern.fullmatch(part) for pattern in _CONVERSATION_PARTS.values())


def _item_part(part: str, media: str) -> tuple[int, int | None, str | None] | None:
    """A conversation part's item index, video frame index and video container (None where
    not one); None: not an item part of ``media``."""
    if match := _CONVERSATION_PARTS[media].fullmatch(part):
        return int(match.group(1)), match.group(2) and int(match.group(2)), None
    if media == "image" and (match := _VIDEO_FILE_PART.fullmatch(part)):
        return int(match.group(1)), None, match.group(2)
    return None


def _conversation_items(raw: dict[str, Any], media: str) -> list[Any]:
    """A conversation's items of ``media`` (a video: its frames, in frame order, or its file as
    ``{"file", "container"}``) in index order; the indices must run 0..N-1."""
    field = f"{media}s"
    numbered: dict[int, Any] = {}
    frames: dict[int, dict[int, Any]] = {}
    for part, data in raw.items():
        if (found := _item_part(part, media)) is None:
            continue
        index, frame, container = found
        if index in numbered or (frame is None and index in frames):
            raise BadSampleError(raw["__key__"], f"{field}[{index}]", f"is stored as more than "
                                 f"one {media} part, or as an image and video frames; keep one")
        if frame is not None:
            frames.setdefault(index, {})[frame] = data
        else:
            numbered[index] = data if container is None else {"file": data,
                                                              "container": container}
    if sorted({*numbered, *frames}) != list(range(len(numbered) + len(frames))):
        raise BadSampleError(raw["__key__"], field, f"has {media} parts numbered "
                             f"{sorted({*numbered, *frames})}; they must run 0..N-1 (rewrite the "
                             "dataset with python -m tools.make_energon_dataset --kind "
                             "conversation)")
    for index, held in frames.items():
        if sorted(held) != list(range(len(held))):
            raise BadSampleError(raw["__key__"], f"{field}[{index}]", f"has video frame "
                                 f"parts numbered {sorted(held)}; they must run 0..N-1")
        numbered[index] = [held[frame] for frame in sorted(held)]
    legacy = [raw[part] for part in IMAGE_PARTS if part in raw] if media == "image" else []
    return legacy + [numbered[index] for index in sorted(numbered)]


def load_conversation(raw: dict[str, Any]) -> dict[str, Any]:
    """Fields of ``ConversationSample`` from numbered image and audio parts and a ``json`` list
    of turns (kept as JSON text, re-serialized where Energon's decoder already parsed it)."""
    turns = raw["json"]
    text = json.dumps(turns) if isinstance(turns, (list, dict)) else _text(raw, "json")
    return dict(images=_conversation_items(raw, "image"),
                audios=_conversation_items(raw, "audio"), conversation=text)


Loader = Callable[[dict[str, Any]], dict[str, Any]]
"""A sample loader: a sample's tar parts -> its sample type's fields."""


@dataclasses.dataclass(frozen=True)
class SampleKind:
    """What one sample type carries: its media fields and the text fields its loss target (and
    prompt) come from, and the loader that fills them from a ``tools.make_energon_dataset``
    sample's parts."""

    sample_type: type[Sample]
    media: tuple[str, ...]
    target: str
    loader: Loader
    prompt: str | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field training reads, so every field a dataset's ``field_map`` must fill."""
        return (*self.media, *([self.prompt] if self.prompt else []), self.target)

    def read_fields(self, media: Collection[str]) -> tuple[str, ...]:
        """The fields a run whose encoders read ``media`` needs filled: every field (the sample
        type requires each)."""
        return self.fields

    @property
    def one_item_each(self) -> bool:
        """Every sample holds exactly one item of each of its media kinds."""
        return True

    @property
    def part_filter(self) -> Callable[[str], bool] | None:
        """Energon's part filter where the parts cannot be listed (numbered items); None: the
        dataset lists them."""
        return None

    def items(self, sample: Any, media: str) -> list[tuple[str, Any]]:
        """The sample's undecoded items of ``media`` in order, each with the field it came from
        (for messages); a missing or empty one stops naming the sample."""
        data = getattr(sample, media, None)
        if not data:
            raise BadSampleError(sample.__key__, media, "is missing or empty")
        return [(media, data)]

    def text(self, sample: Any) -> SampleText:
        """The sample's text as ``str``: a ``field_map`` hands text parts over as raw bytes."""
        key = sample.__key__
        prompt = decode_text(getattr(sample, self.prompt), key, self.prompt) if self.prompt else ""
        target = getattr(sample, self.target)
        if isinstance(target, (list, tuple)):  # VQA answers: the first one is the target.
            if not target:
                raise BadSampleError(key, self.target, "is an empty list")
            target = target[0]
        return SampleText(prompt, decode_text(target, key, self.target))


@dataclasses.dataclass(frozen=True)
class ConversationKind(SampleKind):
    """Multi-turn samples: ``target`` holds the turns as JSON text, rendered with the chat
    template; each media kind's 0..N items are in a list field (``image`` -> ``images``)."""

    @property
    def fields(self) -> tuple[str, ...]:
        return (*(f"{media}s" for media in self.media), self.target)

    def read_fields(self, media: Collection[str]) -> tuple[str, ...]:
        """The item lists of the ``media`` read (the others default to empty) and the turns."""
        return (*(f"{kind}s" for kind in self.media if kind in media), self.target)

    @property
    def one_item_each(self) -> bool:
        return False

    @property
    def part_filter(self) -> Callable[[str], bool]:
        return conversation_parts

    def items(self, sample: Any, media: str) -> list[tuple[str, Any]]:
        field = f"{media}s"
        data = getattr(sample, field, None)
        if data is None:
            raise BadSampleError(sample.__key__, field, "is missing")
        if isinstance(data, (bytes, bytearray, memoryview)):  # a field_map's single part
            data = [data]
        for index, item in enumerate(data):
            if not item:
                raise BadSampleError(sample.__key__, f"{field}[{index}]", "is empty")
        return [(f"{field}[{index}]", item) for index, item in enumerate(data)]

    def text(self, sample: Any) -> Conversation:  # type: ignore[override]
        """The sample's turns, each a ``(role, content)`` of a known role."""
        key = sample.__key__
        raw = decode_text(getattr(sample, self.target), key, self.target)
        try:
            turns = json.loads(raw)
        except json.JSONDecodeError as error:
            raise BadSampleError(key, self.target, f"is not JSON ({error.msg})") from None
        if not isinstance(turns, list) or not all(
                isinstance(turn, dict) and turn.get("role") in ROLES
                and isinstance(turn.get("content"), str) for turn in turns):
            raise BadSampleError(key, self.target, "is not a list of {role, content} turns "
                                 f"with role one of {', '.join(ROLES)}")
        return Conversation(tuple((turn["role"], turn["content"]) for turn in turns))


DATASET_KINDS: dict[str, SampleKind] = {
    "caption": SampleKind(CaptioningSample, ("image",), "caption", load_caption),
    "vqa": SampleKind(VQASample, ("image",), "answers", load_vqa, prompt="context"),
    "transcript": SampleKind(AudioTranscriptSample, ("audio",), "transcript", load_transcript),
    "image_audio_caption": SampleKind(ImageAudioCaptionSample, ("image", "audio"), "caption",
                                      load_image_audio_caption),
    "conversation": ConversationKind(ConversationSample, ("image", "audio"), "conversation",
                                     load_conversation),
}
"""Each kind of ``tools.make_energon_dataset --kind``, the sample type training reads."""

SAMPLE_KINDS: dict[str, SampleKind] = {
    kind.sample_type.__name__: kind for kind in DATASET_KINDS.values()}
"""The same kinds by sample class name, as a ``dataset.yaml`` names them (also for folders
prepared by ``energon prepare``)."""


def sample_kind(sample: Any) -> SampleKind:
    """The kind of a loaded sample."""
    return SAMPLE_KINDS[type(sample).__name__]
