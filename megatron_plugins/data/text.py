"""A sample's text, and how the run names its tokens: the placeholders, the markers and the
tokenizer flags (``--tokenizer-model``, ``--tokenizer-special-tokens``, ``--chat-template``).

Each encoder's output fills a block of positions marked by its placeholder token (``<vision>``),
a special token added to the tokenizer exactly as stock Megatron's ``HuggingFaceTokenizer`` adds
``--tokenizer-special-tokens`` (``additional_special_tokens``, appended in order after the
tokenizer's own tokens). The launch puts the placeholders into that flag
(:func:`special_tokens_flag`), so stock's tokenizer, its padded vocabulary and the embedding rows
agree with the ids :class:`~megatron_plugins.data.tokenizer.PromptTokenizer` lays out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_plugins.errors import FlagError

__all__ = [
    "ROLES", "Conversation", "SampleText", "check_tokenizer_folder", "load_hf_tokenizer",
    "marker_sequence", "media_marker", "place_markers", "placeholder_token", "read_chat_template",
    "special_tokens_flag"
]

_EXPECTED_FILES = "tokenizer.json and/or tokenizer_config.json (as save_pretrained writes them)"


@dataclass(frozen=True)
class SampleText:
    """A sample's text: ``prompt`` is context only, the loss covers ``target`` (and the end token).

    Caption and transcript: prompt ``""``; VQA: prompt the question, target the answer.
    """

    prompt: str
    target: str


ROLES = ("system", "user", "assistant")
"""The roles a conversation turn may have (the chat templates' own names)."""


@dataclass(frozen=True)
class Conversation:
    """A multi-turn sample's text: ``(role, content)`` turns, the loss on the assistant turns only.

    An encoder's ``i``-th item sits at the ``i``-th of its markers (:func:`media_marker`), in turn
    order; with no marker, all its items at the start of the first user turn.
    """

    turns: tuple[tuple[str, str], ...]


def placeholder_token(encoder: str) -> str:
    """The special token whose positions the encoder's output fills."""
    return f"<{encoder}>"


def media_marker(media: str) -> str:
    """The text marking where a conversation's item of ``media`` sits (LLaVA's ``<image>``)."""
    return f"<{media}>"


def place_markers(turns: Sequence[tuple[str, str]], markers: Mapping[str, str],
                  items: Mapping[str, int]) -> list[tuple[str, str]]:
    """The turns with each encoder's markers (``markers``: encoder -> marker) where its
    ``items`` sit: as many markers as it has items, or none, and then that many put at the start
    of the first user turn (encoder by encoder, each before the ones put already). ValueError
    naming the marker when the counts differ or there is no user turn to put them in."""
    placed = [list(turn) for turn in turns]
    for name, marker in markers.items():
        count, wanted = sum(content.count(marker) for _, content in placed), items.get(name, 0)
        if count and count != wanted:
            raise ValueError(f"it holds {count} {marker} marker{'s' * (count != 1)} for "
                             f"{wanted} item{'s' * (wanted != 1)} of that kind; give one "
                             "marker per item (or none)")
        if wanted and not count:
            first_user = next((turn for turn in placed if turn[0] == "user"), None)
            if first_user is None:
                raise ValueError(f"it has no {marker} marker and no user turn to put its "
                                 f"{wanted} item{'s' * (wanted != 1)} in")
            first_user[1] = f"{marker}\n" * wanted + first_user[1]
    return [(role, content) for role, content in placed]


def marker_sequence(turns: Sequence[tuple[str, str]], markers: Mapping[str, str]) -> list[str]:
    """The encoders whose markers the (placed) turns hold, in the order the text holds them:
    the order of every encoder's items in the sequence."""
    by_marker = {marker: name for name, marker in markers.items()}
    pattern = "|".join(map(re.escape, by_marker))
    return [by_marker[found] for _, content in turns for found in re.findall(pattern, content)]


def read_chat_template(value: str | None) -> str | None:
    """Stock ``--chat-template``: Jinja text, or the path of a Jinja file (read here, so a missing
    file is one line before any process group)."""
    if not value:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise FlagError(f"--chat-template {value}: no such file, and not Jinja template text; give "
                    "a Jinja file (or its text), e.g. --chat-template chat_template.jinja")


def special_tokens_flag(existing: Sequence[str] | None, encoders: Sequence[str]) -> list[str]:
    """The value for stock ``args.special_tokens`` (``--tokenizer-special-tokens``): the user's
    tokens kept in order, each missing placeholder appended, so stock builds our tokenizer.

    Idempotent: applying it to its own result changes nothing.
    """
    tokens = list(existing or [])
    return tokens + [placeholder_token(name) for name in encoders
                     if placeholder_token(name) not in tokens]


def check_tokenizer_folder(folder: str) -> None:
    """``--tokenizer-model`` must be a folder this user can read; a :class:`FlagError` if not."""
    path = Path(folder)
    problem = ("no such folder" if not path.is_dir()
               else "this user cannot read it" if not os.access(path, os.R_OK | os.X_OK) else None)
    if problem is not None:
        raise FlagError(f"--tokenizer-model {folder}: {problem}; give a folder holding a "
                        f"HuggingFace tokenizer ({_EXPECTED_FILES})")


def load_hf_tokenizer(folder: str, special_tokens: Sequence[str]) -> Any:
    """The HuggingFace tokenizer of ``folder`` with ``special_tokens`` added as stock adds them."""
    check_tokenizer_folder(folder)
    # Imported here: transformers takes seconds to import, and only tokenizing ranks need it.
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any failure means the folder holds no tokenizer
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise FlagError(f"--tokenizer-model {folder} is not a HuggingFace tokenizer folder "
                        f"(expected {_EXPECTED_FILES}): {reason}") from None
    hf.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    return hf
