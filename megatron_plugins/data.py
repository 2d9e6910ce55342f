"""Multimodal mock data that is aligned across grids by construction.

Every sample is a pure function of ``(seed, split, global sample index)``: its class label, its
text tokens, where each encoder's tokens sit, and each encoder's inputs (each drawn from its own
seeded stream, so a rank that builds only part of a sample still builds the same part). Every
rank derives from the topology alone which global indices it needs for each microbatch, in the
order Megatron's bridge communicator fans encoder DP replicas in and out of language DP
replicas, so an encoder rank and the language rank receiving its output always agree.

Global microbatch ``k`` of a split covers samples ``start + k*M .. start + (k+1)*M - 1`` with
``M = micro_batch_size * language_dp``; DP replica ``r`` of a module with per-replica batch ``b``
takes the ``r``-th run of ``b`` consecutive samples in it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.layout import LANGUAGE, LayoutError, encoder_micro_batch_size
from megatron_plugins.topology import HeteroTopology

SPLITS = ("train", "valid", "test")
NUM_CLASSES = 8
"""Mock samples belong to one of these classes; encoders see it, text depends on it."""


def special_token_ids(vocab_size: int, encoders: Sequence[str]) -> dict[str, int]:
    """Each encoder's placeholder id: the top ids of the vocabulary, never used by text."""
    return {name: vocab_size - 1 - index for index, name in enumerate(encoders)}


def _generator(seed: int, split: str, index: int, stream: int) -> torch.Generator:
    entropy = np.random.SeedSequence([seed, SPLITS.index(split), index, stream])
    return torch.Generator().manual_seed(int(entropy.generate_state(1, np.uint64)[0] >> 1))


@dataclass(frozen=True)
class MockMultimodalSamples:
    """Deterministic multimodal samples: text with each encoder's token block inside it.

    Text follows a per-class arithmetic progression, so the language model can learn to continue
    it and must read the encoders to know the class (its first token and step).
    """

    seed: int
    seq_length: int
    vocab_size: int
    plugins: dict[str, EncoderPlugin]

    def __post_init__(self) -> None:
        encoder_tokens = sum(p.tokens_per_sample for p in self.plugins.values())
        if encoder_tokens + 2 > self.seq_length:
            raise LayoutError(
                f"--seq-length {self.seq_length} leaves no room for text: the encoders fill "
                f"{encoder_tokens} positions per sample; raise --seq-length above "
                f"{encoder_tokens + 1}"
            )
        if self.text_vocab_size < NUM_CLASSES:
            raise LayoutError(
                f"--vocab-size {self.vocab_size} is too small: {len(self.plugins)} ids are "
                f"reserved for encoder tokens and text needs at least {NUM_CLASSES}"
            )

    @property
    def text_vocab_size(self) -> int:
        """Ids below this are text; the ones above are the encoders' special tokens."""
        return self.vocab_size - len(self.plugins)

    @property
    def special_token_ids(self) -> dict[str, int]:
        return special_token_ids(self.vocab_size, list(self.plugins))

    def label(self, split: str, index: int) -> int:
        """The sample's class."""
        return int(torch.randint(NUM_CLASSES, (1,), generator=_generator(self.seed, split, index, 0)))

    def text(self, split: str, index: int) -> dict[str, torch.Tensor]:
        """Tokens, labels, loss mask and position ids of one sample (language ranks)."""
        label = self.label(split, index)
        generator = _generator(self.seed, split, index, 1)
        text_vocab = self.text_vocab_size
        step = 1 + label % 3
        first = label * (text_vocab // NUM_CLASSES) + int(torch.randint(2, (1,), generator=generator))
        blocks = [(self.special_token_ids[name], plugin.tokens_per_sample)
                  for name, plugin in self.plugins.items()]
        text_length = self.seq_length - sum(count for _, count in blocks)
        cuts = sorted(torch.randperm(text_length + 1, generator=generator)[:len(blocks)].tolist())
        progression = [(first + step * k) % text_vocab for k in range(text_length)]
        tokens: list[int] = []
        previous = 0
        for cut, (token_id, count) in zip(cuts, blocks):
            tokens += progression[previous:cut] + [token_id] * count
            previous = cut
        tokens += progression[previous:]
        tokens_t = torch.tensor(tokens, dtype=torch.long)
        following = torch.cat([tokens_t[1:], torch.tensor([-1])])
        is_text = (following >= 0) & (following < text_vocab)
        return {
            "tokens": tokens_t,
            "labels": torch.where(is_text, following, torch.zeros_like(following)),
            "loss_mask": is_text.float(),
            "position_ids": torch.arange(self.seq_length, dtype=torch.long),
        }

    def encoder_inputs(self, name: str, split: str, index: int) -> dict[str, torch.Tensor]:
        """One encoder's inputs for one sample (encoder ranks)."""
        stream = 2 + list(self.plugins).index(name)
        return self.plugins[name].sample_inputs(
            _generator(self.seed, split, index, stream), self.label(split, index)
        )


def _stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


class MicrobatchStream(Iterator[dict[str, Any]]):
    """This rank's microbatches of one split, starting at global sample ``start``."""

    def __init__(self, samples: MockMultimodalSamples, topology: HeteroTopology, split: str,
                 start: int, micro_batch_size: int) -> None:
        layout = topology.layout
        [self._module] = topology.active_modules
        pgc = topology.module_pgs[self._module]
        self._samples = samples
        self._split = split
        self._global = micro_batch_size * layout.language.dp
        self._batch = (micro_batch_size if self._module == LANGUAGE
                       else encoder_micro_batch_size(layout, self._module, micro_batch_size))
        self._next = start + pgc.dp.rank() * self._batch
        mask = torch.ones(samples.seq_length, samples.seq_length, dtype=torch.bool)
        self._attention_mask = torch.triu(mask, diagonal=1).unsqueeze(0)

    def __next__(self) -> dict[str, Any]:
        indices = range(self._next, self._next + self._batch)
        self._next += self._global
        if self._module == LANGUAGE:
            batch = _stack([self._samples.text(self._split, i) for i in indices])
            batch["attention_mask"] = self._attention_mask.expand(len(indices), -1, -1, -1)
            batch["sample_ids"] = torch.tensor(list(indices))
            return batch
        inputs = _stack([self._samples.encoder_inputs(self._module, self._split, i)
                         for i in indices])
        return {"modality_inputs": {self._module: {self._module: inputs}},
                "sample_ids": torch.tensor(list(indices))}


def data_provider(samples: MockMultimodalSamples, topology: HeteroTopology,
                  get_args: Callable[[], Any]) -> Callable[[Any], tuple]:
    """The ``train_valid_test_dataset_provider`` for stock ``pretrain()``.

    Run with ``--dataloader-type external``: stock passes the returned iterators through. It is
    called on every rank (``is_distributed``) and resumes where the checkpoint's consumed-sample
    counters say.
    """

    def provider(train_valid_test_num_samples: Any, vp_stage: int | None = None) -> tuple:
        args = get_args()
        starts = (args.consumed_train_samples, args.consumed_valid_samples, 0)
        return tuple(MicrobatchStream(samples, topology, split, start, args.micro_batch_size)
                     for split, start in zip(SPLITS, starts))

    provider.is_distributed = True
    return provider
