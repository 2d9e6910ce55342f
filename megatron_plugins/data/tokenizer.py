"""One sample's text as the language model's fixed-length inputs, with a real HuggingFace tokenizer.

:class:`PromptTokenizer` lays out ``[bos] + placeholder runs + prompt + target + eos + pad`` for a
single-turn sample, or renders a conversation with the chat template, each item's placeholder run
at its marker and the loss on the assistant turns only; the placeholders and markers are named in
:mod:`.text`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_plugins.data.text import (
    Conversation,
    SampleText,
    load_hf_tokenizer,
    place_markers,
    placeholder_token,
    special_tokens_flag,
)
from megatron_plugins.errors import FlagError

__all__ = ["EncodedText", "PromptTokenizer"]


@dataclass(frozen=True)
class EncodedText:
    """One sample's language inputs, all ``[seq_length]``; ``truncated`` when target or end was
    cut; ``length`` the positions it fills before its padding."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    truncated: bool
    length: int

    def as_batch_fields(self) -> dict[str, torch.Tensor]:
        """The per-sample fields a batch stacks (``truncated`` is counted, not stacked; the
        length is the ``"length"`` field, as ``streams.LENGTH`` names it)."""
        return {"tokens": self.tokens, "labels": self.labels, "loss_mask": self.loss_mask,
                "position_ids": self.position_ids, "length": torch.tensor(self.length)}


class PromptTokenizer:
    """Lays out one sample's tokens: ``[bos] + placeholder blocks + prompt + target + eos + pad``.

    Pickles without the HuggingFace object and reloads it from ``folder``, so Energon worker
    processes get a working copy.
    """

    def __init__(self, folder: str, special_tokens: Sequence[str], encoders: Sequence[str],
                 hf: Any, chat_template: str | None = None,
                 checkpoint_tokens: Mapping[str, int] | None = None,
                 wrapping: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.folder = folder
        self.wrapping = dict(wrapping or {})
        """Encoder -> (start, end) ids around each of its runs (Qwen's ``<|vision_start|>`` /
        ``<|vision_end|>``), as the checkpoint's own processor puts them."""
        self.chat_template: str | None = chat_template or getattr(hf, "chat_template", None)
        self.special_tokens = tuple(special_tokens)
        self._hf = hf
        given = dict(checkpoint_tokens or {})
        self.placeholder_ids = {
            name: given[name] if name in given
            else int(hf.convert_tokens_to_ids(placeholder_token(name))) for name in encoders}
        self.eos_id: int = hf.eos_token_id
        self.pad_id: int = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
        self.bos_id: int | None = hf.bos_token_id

    @classmethod
    def load(cls, folder: str, encoders: Sequence[str], padded_vocab_size: int,
             special_tokens: Sequence[str] | None = None,
             chat_template: str | None = None,
             checkpoint_tokens: Mapping[str, int] | None = None,
             wrapping: Mapping[str, tuple[int, int]] | None = None) -> PromptTokenizer:
        """Load ``folder`` (``--tokenizer-model``) with ``special_tokens_flag(special_tokens,
        encoders)`` added; a :class:`FlagError` when it cannot serve the run.

        ``special_tokens`` is stock's ``args.special_tokens`` (before or after the launch
        appended the placeholders); ``padded_vocab_size`` the model's embedding rows;
        ``chat_template`` (Jinja text, from ``--chat-template``) replaces the tokenizer's own;
        ``checkpoint_tokens`` (encoder -> id) marks those encoders' positions with a pretrained
        model's own token (``--hf-model``'s image token, e.g. Qwen's ``<|image_pad|>``) instead of
        the added ``<NAME>``; ``wrapping`` (encoder -> (start, end) ids) puts those ids around
        each of that encoder's runs where the text does not already (Qwen's
        ``<|vision_start|>`` / ``<|vision_end|>``).
        """
        tokens = special_tokens_flag(special_tokens, encoders)
        hf = load_hf_tokenizer(folder, tokens)
        if hf.eos_token_id is None:
            raise FlagError(f"--tokenizer-model {folder} has no end-of-sequence token (eos_token); "
                            "the loss trains the model to end its answer, so use a tokenizer "
                            "with one")
        tokenizer = cls(folder, tokens, encoders, hf, chat_template, checkpoint_tokens, wrapping)
        marks = [(name, token_id) for name, token_id in (checkpoint_tokens or {}).items()]
        marks += [(name, token_id) for name, ids in (wrapping or {}).items() for token_id in ids]
        for name, token_id in marks:
            if not 0 <= token_id < len(hf):
                raise FlagError(f"--tokenizer-model {folder} has {len(hf)} tokens, but the "
                                f"checkpoint marks encoder {name}'s positions with id {token_id}; "
                                "give the checkpoint's own tokenizer")
        tokenizer._check_room(padded_vocab_size)
        return tokenizer

    def require_chat_template(self, needed_by: str) -> None:
        """A :class:`FlagError` when conversations must be rendered and there is no template."""
        if self.chat_template is None:
            raise FlagError(
                f"--tokenizer-model {self.folder} has no chat template, which {needed_by} needs "
                "to render its conversations; use a tokenizer with one (chat_template in its "
                "tokenizer_config.json) or give --chat-template FILE (a Jinja template)")

    def _check_room(self, padded_vocab_size: int) -> None:
        """Every id needs an embedding row; stock pads ``len(tokenizer)`` (placeholders included
        when they are in ``--tokenizer-special-tokens``), so only a smaller explicit or
        checkpoint-restored ``--padded-vocab-size`` leaves none."""
        size = len(self._hf)
        if size <= padded_vocab_size:
            return
        name, token_id = max(self.placeholder_ids.items(), key=lambda item: item[1],
                             default=("", -1))
        what = (f"placeholder token {placeholder_token(name)} (id {token_id})"
                if token_id >= padded_vocab_size else f"token id {size - 1}")
        raise FlagError(
            f"the padded vocabulary ({padded_vocab_size} rows, restored from a checkpoint by "
            f"--use-checkpoint-args) leaves no embedding row for {what}: the tokenizer in "
            f"--tokenizer-model {self.folder} has {size} tokens with the encoders' placeholders; "
            f"drop --use-checkpoint-args or start from a checkpoint trained with these tokens")

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, placeholders included (stock pads from this)."""
        return len(self._hf)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hf": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hf = load_hf_tokenizer(self.folder, self.special_tokens)

    def _ids(self, text: str) -> list[int]:
        """Plain text ids: no tokenizer-added specials, and a literal ``<vision>`` in the text is
        text, so it never claims an encoder's position."""
        return self._hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode(self, text: SampleText, encoder_blocks: Sequence[tuple[str, int]],
               seq_length: int) -> EncodedText:
        """``encoder_blocks``: ``(encoder, tokens_per_item)`` in ``--encoder`` order.

        Too-long text never raises: the prompt, then the target and end token are cut to fit and
        ``truncated`` is set; with no target token left the loss mask is all zero. Raises
        ValueError only when the placeholder blocks alone exceed ``seq_length`` (a caller bug: the
        launch checks ``--seq-length``) or name an encoder the tokenizer was not loaded for.
        """
        unknown = [name for name, _ in encoder_blocks if name not in self.placeholder_ids]
        if unknown:
            raise ValueError(f"encoders {unknown} have no placeholder token in this tokenizer")
        prefix = [] if self.bos_id is None else [self.bos_id]
        for name, count in encoder_blocks:
            prefix += self._wrapped(name, [self.placeholder_ids[name]] * count)
        if len(prefix) > seq_length:
            raise ValueError(f"{len(prefix)} encoder positions do not fit in {seq_length} tokens")
        context = prefix + self._ids(text.prompt)[: seq_length - len(prefix)]
        answer = self._ids(text.target) + [self.eos_id]
        kept = answer[: seq_length - len(context)]
        ids = context + kept
        tokens = torch.full((seq_length,), self.pad_id, dtype=torch.int64)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
        labels = torch.full_like(tokens, self.pad_id)
        labels[:-1] = tokens[1:]
        loss_mask = torch.zeros(seq_length, dtype=torch.float32)
        loss_mask[max(len(context) - 1, 0): len(ids) - 1] = 1.0
        return EncodedText(tokens=tokens, labels=labels, loss_mask=loss_mask,
                           position_ids=torch.arange(seq_length, dtype=torch.int64),
                           truncated=len(kept) < len(answer), length=len(ids))

    def _wrapped(self, name: str, run: list[int]) -> list[int]:
        """``run`` between the encoder's start and end ids, where it has them."""
        if name not in self.wrapping:
            return run
        start, end = self.wrapping[name]
        return [start, *run, end]

    def _marker_text(self, name: str) -> str:
        """What a marker becomes in the rendered text: the token of the encoder's placeholder
        id (the checkpoint's own, e.g. ``<|image_pad|>``, or the added ``<NAME>``)."""
        return str(self._hf.convert_ids_to_tokens(self.placeholder_ids[name]))

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            return self._hf.apply_chat_template(messages, chat_template=self.chat_template,
                                                tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except TemplateError as error:
            raise ValueError(f"the chat template cannot render it: {error}") from None

    def _messages(self, conversation: Conversation, markers: Mapping[str, str],
                  items: Mapping[str, int]) -> list[dict[str, str]]:
        """The turns as chat messages, each encoder's markers replaced by its placeholder token:
        as many markers as the sample has ``items`` of that encoder, or none (then that many put
        at the start of the first user turn)."""
        for name in markers:
            token = self._marker_text(name)
            if token != markers[name] and any(token in content
                                              for _, content in conversation.turns):
                raise ValueError(f"a turn holds {token} as text")
        turns = [list(turn) for turn in place_markers(conversation.turns, markers, items)]
        for name, marker in markers.items():
            for turn in turns:
                turn[1] = turn[1].replace(marker, self._marker_text(name))
        return [{"role": role, "content": content} for role, content in turns]

    def _assistant_spans(self, messages: list[dict[str, str]], rendered: str) -> list[range]:
        """Character spans of each assistant turn in ``rendered``: from the end of the
        conversation before it with the generation prompt to the end of the conversation up to
        it, trailing whitespace left out (so the end-of-turn token is in, the line break not)."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:index], generation_prompt=True)
            upto = self._render(messages[: index + 1])
            if not (upto.startswith(before) and rendered.startswith(upto)):
                raise ValueError("the chat template does not render it incrementally (a turn "
                                 "changes the text before it), so its assistant turns cannot "
                                 "be found")
            spans.append(range(len(before), len(upto.rstrip())))
        return spans

    def encode_conversation(self, conversation: Conversation,
                            encoder_blocks: Sequence[tuple[str, int | tuple[int, ...]]],
                            markers: Mapping[str, str], seq_length: int) -> EncodedText:
        """A conversation rendered with the chat template, each item's placeholder run at its
        marker (``encoder_blocks``: ``(encoder, tokens)`` per item, each encoder's in marker
        order; ``tokens`` a count, or a run's explicit ids, kept whole: a video with its sound
        interleaved); ``markers``: encoder -> marker); the loss on assistant tokens only.

        Too-long text is cut at the end, never inside a placeholder run: text past the row is
        dropped until every run fits (``truncated`` set; no loss across a cut). ValueError when
        the runs alone do not fit, or when the turns cannot be rendered.
        """
        self.require_chat_template("a conversation dataset")
        runs: dict[str, list[int | tuple[int, ...]]] = {name: [] for name in markers}
        for name, count in encoder_blocks:
            runs.setdefault(name, []).append(count)
        messages = self._messages(conversation, markers,
                                  {name: len(counts) for name, counts in runs.items()})
        if not any(message["role"] == "assistant" for message in messages):
            raise ValueError("it has no assistant turn, so nothing to train on")
        rendered = self._render(messages)
        spans = self._assistant_spans(messages, rendered)
        encoded = self._hf(rendered, add_special_tokens=False, return_offsets_mapping=True)
        by_id = {self.placeholder_ids[name]: name for name in runs}
        pending = {name: list(counts) for name, counts in runs.items()}
        ids: list[int] = []
        trained: list[bool] = []
        in_run: list[bool] = []
        rendered_ids = encoded["input_ids"]
        for index, (token_id, (start, end)) in enumerate(zip(rendered_ids,
                                                             encoded["offset_mapping"])):
            if token_id in by_id:
                name = by_id[token_id]
                if not pending[name]:
                    raise ValueError(f"the chat template rendered more {markers[name]} markers "
                                     f"than its {len(runs[name])} items")
                count = pending[name].pop(0)
                explicit = not isinstance(count, int)
                run = self._wrapped(name, list(count) if explicit else [token_id] * count)
                if name in self.wrapping:  # text that already wraps the marker keeps its own
                    following = rendered_ids[index + 1: index + 2]
                    run = run[(ids[-1:] == run[:1]):len(run) - (following == run[-1:])]
                ids += run
                trained += [False] * len(run)
                in_run += [explicit or token == token_id for token in run]
            else:
                ids.append(token_id)
                # Overlap, not containment: a first content token may carry the space before it.
                trained.append(any(start < span.stop and end > span.start for span in spans))
                in_run.append(False)
        for name, left in pending.items():
            if left:
                raise ValueError(f"the chat template dropped {len(left)} of its "
                                 f"{markers[name]} markers")
        return self._fit(ids, trained, in_run, seq_length)

    def _fit(self, ids: list[int], trained: list[bool], in_run: list[bool],
             seq_length: int) -> EncodedText:
        """``ids`` in ``seq_length`` positions: every placeholder run kept whole, text kept from
        the start until the row is full; a position whose next kept token did not follow it in
        ``ids`` trains nothing."""
        room = seq_length - sum(in_run)
        if room < 0:
            raise ValueError(f"its {sum(in_run)} placeholder positions do not fit in "
                             f"--seq-length {seq_length}; raise --seq-length or give it fewer or "
                             "smaller items")
        kept: list[int] = []
        for index, run in enumerate(in_run):
            if run or room > 0:
                kept.append(index)
                room -= not run
        tokens = torch.full((seq_length,), self.pad_id, dtype=torch.int64)
        tokens[: len(kept)] = torch.tensor([ids[i] for i in kept], dtype=torch.int64)
        labels = torch.full_like(tokens, self.pad_id)
        labels[:-1] = tokens[1:]
        loss_mask = torch.zeros(seq_length, dtype=torch.float32)
        for position, (here, following) in enumerate(zip(kept, kept[1:])):
            loss_mask[position] = float(following == here + 1 and trained[following])
        return EncodedText(tokens=tokens, labels=labels, loss_mask=loss_mask,
                           position_ids=torch.arange(seq_length, dtype=torch.int64),
                           truncated=len(kept) < len(ids), length=len(kept))
