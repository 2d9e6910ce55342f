"""The advisor's view of a parsed run: the work per module (:class:`~megatron_plugins.performance.
workload.Workload`) and the data it is planned for.

The launch's own parse gives the language model's config, the encoder plugins and the data source.
The data is described from flags, or sampled through the source the run would read (language side
only: text and the items' metadata, never decoded media). An encoder's FLOPs come from its
plugin's ``item_flops`` on item sizes that fill the positions seen (a square image, a clip);
parameters from the layers' shapes (layer norms and biases left out) and the embedding and
projection FLOPs per row.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

from megatron_plugins.data.addressing import RankSlice
from megatron_plugins.data.streams import ITEM_TOKENS, LENGTH, DataSource
from megatron_plugins.encoders import EncoderPlugin
from megatron_plugins.errors import FlagError
from megatron_plugins.flops.count import EncoderFlops, Flops
from megatron_plugins.media.mock import example_size
from megatron_plugins.model.language import language_config_from_args
from megatron_plugins.parallel.layout import LANGUAGE, ParallelLayout
from megatron_plugins.peft.flags import PROJECTION, LoraSpec, lora_specs
from megatron_plugins.performance.data import (
    DataDescription,
    given_description,
    sampled_description,
)
from megatron_plugins.performance.workload import (
    EncoderWork,
    LanguageWork,
    TransformerShape,
    Workload,
)

__all__ = ["describe_data", "run_workload"]

IMAGE_SIDES = range(8, 8193, 8)
"""Square image sides tried to find an image filling a given number of positions."""


def describe_data(args: argparse.Namespace, plugins: Mapping[str, EncoderPlugin],
                  source: DataSource, layout: ParallelLayout) -> DataDescription:
    """The data the flags describe, else ``--advise-samples`` samples read from ``source``."""
    given = given_description(args, {name: plugin.tokens_per_item
                                     for name, plugin in plugins.items()}, args.seq_length,
                              lambda name, seconds: _clip_tokens(plugins[name], seconds))
    if given is not None:
        return given
    if "num_workers" in {field.name for field in dataclasses.fields(source)}:
        source = dataclasses.replace(source, num_workers=0)
    stream = source.open("train", RankSlice.of(layout, LANGUAGE, 0, args.micro_batch_size), 0,
                         None)
    lengths: list[int] = []
    items: dict[str, list] = {name: [] for name in plugins}
    for _, batch in stream:
        lengths += [int(length) for length in batch[LENGTH]]
        for name in plugins:
            items[name] += list(batch[ITEM_TOKENS][name])
        if len(lengths) >= args.advise_samples:
            break
    where = f"--data-path {args.data_path[0]}" if args.data_path else "the mock data"
    description = sampled_description(lengths, items, where)
    description.check(args.seq_length)
    return description


def _clip_tokens(plugin: EncoderPlugin, seconds: float) -> int:
    """Positions a clip of ``seconds`` fills, by ``plugin``'s own count (``item_tokens``)."""
    preprocessor = plugin.preprocessor()
    flag = f"--advise-clip-seconds {plugin.name}={seconds:g}"
    if preprocessor.media != "audio":
        raise FlagError(f"{flag}: encoder {plugin.name} ({plugin.grid.provider}) takes "
                        f"{preprocessor.media}s, not clips; give --advise-item-tokens "
                        f"{plugin.name}=T")
    rate = preprocessor.sample_rate or 16000
    try:
        return plugin.item_tokens((round(seconds * rate), rate))
    except ValueError as error:
        raise FlagError(f"{flag}: {error}") from None


LONGEST_CLIP_S = 3600
"""The longest clip tried to fill a given number of positions."""


def _clip_samples(plugin: EncoderPlugin, tokens: int, rate: int) -> int:
    """Samples at ``rate`` of the clip whose positions come closest to ``tokens`` (10 ms apart):
    positions grow with a clip's length, so the search doubles, then halves."""
    def count(samples: int) -> int:
        try:
            return plugin.item_tokens((samples, rate))
        except ValueError:  # too short to be a clip
            return 0

    low, high = 1, rate
    while count(high) < tokens and high < LONGEST_CLIP_S * rate:
        low, high = high, 2 * high
    while high - low > rate // 100:
        middle = (low + high) // 2
        low, high = (middle, high) if count(middle) < tokens else (low, middle)
    return min((high, low), key=lambda samples: abs(count(samples) - tokens))


def _item_size(plugin: EncoderPlugin, tokens: int) -> tuple[int, ...]:
    """A size of an item of ``plugin``'s media that fills ``tokens`` positions (the closest)."""
    preprocessor = plugin.preprocessor()
    if plugin.fixed_item_tokens:
        return example_size(preprocessor.media, preprocessor.sample_rate)
    if preprocessor.media != "image":
        rate = preprocessor.sample_rate or 16000
        return (_clip_samples(plugin, tokens, rate), rate)
    best, gap = None, None
    for side in IMAGE_SIDES:
        try:
            found = abs(plugin.item_tokens((side, side)) - tokens)
        except ValueError:
            continue
        if gap is None or found < gap:
            best, gap = (side, side), found
    if best is None:
        raise FlagError(f"--encoder {plugin.name}: no {preprocessor.media} size fills {tokens} "
                        "positions; give --advise-item-tokens it can fill")
    return best


def _encoder_work(plugin: EncoderPlugin, data: DataDescription, language: object,
                  args: argparse.Namespace, lora: Mapping[str, LoraSpec]) -> EncoderWork:
    """One encoder's work per sample over the data's items: its tower and projection trained,
    frozen or LoRA'd (``lora``: the run's specs by part)."""
    name = plugin.name
    if not plugin.counts_flops:
        raise FlagError(f"--encoder {name}={plugin.grid.provider}: {type(plugin).__name__} does "
                        "not count its FLOPs (EncoderPlugin.item_flops), which the advisor needs")
    config = plugin.transformer_config(language)
    shape = TransformerShape.of(config)
    frozen = name in args.freeze_encoder
    tower, projection_lora = lora.get(name), lora.get(name + PROJECTION)
    encoder_trains = not frozen and tower is None
    projection_trains = (not frozen and name not in args.freeze_projection
                         and projection_lora is None)
    adapters = {"encoder_adapters": tower and tower.adapters,
                "projection_adapters": projection_lora and projection_lora.adapters}
    described = data.encoders[name]
    total, flops, tokens, entry_params, projection_params = 0, Flops(), 0.0, 0.0, 0.0
    for item_tokens, count in described.item_tokens:
        counted: EncoderFlops = plugin.item_flops(_item_size(plugin, item_tokens), config,
                                                  args.hidden_size)
        flops += counted.flops(encoder_trains=encoder_trains,
                               projection_trains=projection_trains, **adapters) * count
        layer_tokens = counted.encoder.inner / (2 * shape.params) if shape.params else 0.0
        tokens += layer_tokens * count
        entry_params = max(entry_params, counted.encoder.entry / (2 * max(layer_tokens, 1)))
        projection = counted.projection.entry + counted.projection.inner
        projection_params = max(projection_params, projection / (2 * max(item_tokens, 1)))
        total += count
    per_sample = described.items_per_sample / total if total else 0.0
    tower_adapters = shape.adapter_params(tower.adapters)[0] if tower else 0
    trained = ((shape.params + entry_params if encoder_trains else tower_adapters)
               + (projection_params if projection_trains else 0))
    return EncoderWork(
        name=name, shape=shape,
        params=int(shape.params + entry_params + projection_params + tower_adapters),
        flops=flops * per_sample, tokens=tokens * per_sample,
        output_tokens=described.tokens_per_sample,
        output_width=args.hidden_size * (1 + plugin.deepstack_levels),
        trained_params=int(trained))


def _state_bytes(args: argparse.Namespace) -> dict[str, float]:
    """Bytes per parameter of weights, the gradient buffer and the optimizer state on the GPU
    (``--optimizer-cpu-offload`` keeps ``--optimizer-offload-fraction`` of the state on the
    CPU: Megatron's HybridDeviceOptimizer), and that fraction."""
    weights = args.params_dtype.itemsize
    grads = 4 if args.accumulate_allreduce_grads_in_fp32 or weights == 4 else weights
    main = args.main_params_dtype.itemsize if weights < 4 else 0
    moments = (args.exp_avg_dtype.itemsize + args.exp_avg_sq_dtype.itemsize
               if args.optimizer == "adam" else 4)
    offloaded = args.optimizer_offload_fraction if args.optimizer_cpu_offload else 0.0
    return {"bytes_per_param": weights, "grad_bytes": grads,
            "optimizer_bytes": (main + moments) * (1 - offloaded),
            "optimizer_offloaded": offloaded}


def run_workload(args: argparse.Namespace, plugins: Mapping[str, EncoderPlugin],
                 data: DataDescription) -> Workload:
    """The run's work per module for ``data``."""
    if args.padded_vocab_size is None:  # Stock pads it when it builds the tokenizer.
        build_tokenizer(args)
    model = language_config_from_args(args)
    config = model.transformer
    shape = TransformerShape.of(config)
    hidden, vocab = config.hidden_size, args.padded_vocab_size
    output = vocab * hidden
    embedding = output + (args.max_position_embeddings * hidden
                          if args.position_embedding_type == "learned_absolute" else 0)
    mtp = (config.mtp_num_layers or 0) * (2 * hidden * hidden + shape.params // shape.layers)
    lora = lora_specs(getattr(args, "lora", None) or [], None)
    encoders = tuple(_encoder_work(plugin, data, config, args, lora)
                     for plugin in plugins.values())
    adapted = lora.get(LANGUAGE)
    language = LanguageWork(
        config, vocab, args.seq_length, data.sample_tokens,
        packed=bool(getattr(args, "pack_sequences", False)),
        trains=not args.freeze_language_model and adapted is None,
        input_grad=any(work.trained_params for work in encoders),
        adapters=adapted and adapted.adapters,
        embedding_params=embedding,
        output_params=output if args.untie_embeddings_and_output_weights else 0,
        mtp_params=mtp)
    return Workload(language, encoders, args.global_batch_size,
                    distributed_optimizer=args.use_distributed_optimizer,
                    overlap_grad_reduce=args.overlap_grad_reduce,
                    **_state_bytes(args))
