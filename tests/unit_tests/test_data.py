"""Data addressing, the alignment guard and the mock source: grids agree on every microbatch."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from megatron_plugins.data import addressing
from megatron_plugins.data.addressing import (
    AlignmentGuard,
    DataMisalignmentError,
    RankSlice,
    _first_difference,
)
from megatron_plugins.data.mock import MockSource
from megatron_plugins.data.streams import (
    COLOCATED,
    ITEM_TOKENS,
    ColocatedStream,
    alignment_guard,
    data_provider,
    rank_slice,
)
from megatron_plugins.encoders.audio import AudioFrameEncoder
from megatron_plugins.encoders.vit import ViTEncoder
from megatron_plugins.parallel.layout import (
    LANGUAGE,
    LayoutError,
    ModulePlacement,
    ParallelLayout,
    encoder_micro_batch_size,
)


def _layout(encoder_dp: int, language_dp: int) -> ParallelLayout:
    return ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=encoder_dp, rank_offset=0, provider="vit"),
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=encoder_dp,
                        provider="audio"),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=language_dp, rank_offset=encoder_dp + 1),
    ))


def _source(layout: ParallelLayout, seq_length: int = 32) -> MockSource:
    parser = argparse.ArgumentParser()
    ViTEncoder.add_arguments(parser)
    AudioFrameEncoder.add_arguments(parser)
    args = parser.parse_args([])
    plugins = {"vision": ViTEncoder("vision", args, layout.module("vision")),
               "audio": AudioFrameEncoder("audio", args, layout.module("audio"))}
    return MockSource(seed=1234, seq_length=seq_length, vocab_size=128, plugins=plugins)


def _streams(layout: ParallelLayout, module: str, start: int = 0) -> list:
    source = _source(layout)
    return [source.open("train", RankSlice.of(layout, module, r, 2), start)
            for r in range(layout.module(module).dp)]


@pytest.mark.parametrize("encoder_dp, language_dp", [(1, 2), (2, 1), (4, 2), (2, 2), (1, 1)],
                         ids=["fan-out", "fan-in", "fan-in-2", "same", "single"])
def test_encoder_replicas_feed_exactly_the_samples_their_language_replicas_hold(
        encoder_dp, language_dp):
    layout = _layout(encoder_dp, language_dp)
    vision, language = _streams(layout, "vision", 16), _streams(layout, LANGUAGE, 16)
    for _ in range(3):  # three consecutive microbatches
        # The bridge concatenates encoder replicas in DP order, then splits evenly over
        # language replicas in DP order (fan-in and fan-out alike).
        encoder_keys = [key for stream in vision for key in next(stream)[0]]
        language_keys = [key for stream in language for key in next(stream)[0]]
        assert encoder_keys == language_keys
        assert len(set(language_keys)) == 2 * language_dp


def test_a_sample_is_the_same_wherever_it_is_built():
    source, again = _source(_layout(1, 1)), _source(_layout(2, 2))
    for index in (0, 7, 1000):
        for key, value in source.text("train", index).items():
            assert torch.equal(value, again.text("train", index)[key]), key
        for name in ("vision", "audio"):
            first, second = source.media(name, "train", index), again.media(name, "train", index)
            assert len(first) == len(second)
            for one, other in zip(first, second):
                assert (one == other).all() if name == "vision" else (
                    one.samples == other.samples).all()
    assert not torch.equal(source.text("train", 3)["tokens"], source.text("valid", 3)["tokens"])


def test_mock_media_go_through_each_encoders_preprocessing():
    layout = _layout(1, 1)
    [vision] = _streams(layout, "vision")
    [audio] = _streams(layout, "audio")
    [language] = _streams(layout, LANGUAGE)
    for _ in range(4):
        _, batch = next(vision)
        items = sum(len(counts) for counts in batch[ITEM_TOKENS]["vision"])
        inputs = batch["modality_inputs"]
        assert (inputs is None if items == 0 else
                inputs["vision"]["vision"]["x"].shape == (items, 3, 16, 16))
        _, batch = next(audio)
        items = sum(len(counts) for counts in batch[ITEM_TOKENS]["audio"])
        inputs = batch["modality_inputs"]
        assert (inputs is None if items == 0 else
                inputs["audio"]["audio"]["frames"].shape == (items, 8, 16))
        _, batch = next(language)
        assert batch["tokens"].shape == (2, 32) and "attention_mask" not in batch
        assert set(batch[ITEM_TOKENS]) == {"vision", "audio"}


def test_mock_samples_hold_zero_to_two_items_of_varied_sizes_per_encoder():
    source = _source(_layout(1, 1))
    counts = [len(source.item_sizes("vision", "train", index)) for index in range(60)]
    assert set(counts) == {0, 1, 2}
    sizes = {size for index in range(60) for size in source.item_sizes("vision", "train", index)}
    assert len(sizes) > 8 and any(height != width for height, width in sizes)
    both = [index for index in range(60)
            if not source.item_sizes("vision", "train", index)
            and not source.item_sizes("audio", "train", index)]
    assert both, "text-only samples occur"
    for index in range(60):
        media = source.media("vision", "train", index)
        assert [image.shape[:2] for image in media] == source.item_sizes("vision", "train", index)
    fixed = MockSource(seed=1234, seq_length=32, vocab_size=128, plugins=source.plugins,
                       items_per_sample=(1, 1))
    assert fixed.static_shapes and not source.static_shapes
    assert {len(fixed.item_sizes("audio", "train", index)) for index in range(20)} == {1}


@pytest.mark.parametrize("text", ["3:1", "0", "a:b", "-1:2", "0:0"])
def test_mock_items_per_sample_refuses_bad_bounds(text):
    from megatron_plugins.data.sources import _items_per_sample
    from megatron_plugins.errors import DataFlagError

    with pytest.raises(DataFlagError, match=f"--mock-items-per-sample {text}: give MIN:MAX"):
        _items_per_sample(text)


@pytest.mark.parametrize("fps", [0.0, -2.0])
def test_mock_video_fps_refuses_a_rate_that_is_not_positive(fps):
    import argparse

    from megatron_plugins.data.sources import _mock_video_fps
    from megatron_plugins.errors import DataFlagError

    with pytest.raises(DataFlagError, match=f"^--mock-video-fps {fps:g}: give a positive frame "
                       "rate$"):
        _mock_video_fps(argparse.Namespace(mock_video_fps=fps))


def test_text_never_uses_special_tokens_and_labels_skip_encoder_positions():
    source = _source(_layout(1, 1))
    special = source.special_token_ids
    assert special == {"vision": 127, "audio": 126}
    for index in range(20):
        sample = source.text("train", index)
        tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
        for name, token in special.items():
            counts = source.item_tokens("train", index)[name]
            assert int((tokens == token).sum()) == sum(counts)
            assert all(count == source.plugins[name].tokens_per_item for count in counts)
        placeholder = tokens >= source.text_vocab_size
        end = max(int(mask.nonzero().max()) + 2,  # the sample's end: past its last text token
                  int(placeholder.nonzero().max()) + 1 if placeholder.any() else 0)
        media = sum(sum(counts) for counts in source.item_tokens("train", index).values())
        assert media + 2 <= end <= max(source.seq_length // 2, media + 2)  # shorter than a row
        assert (tokens[end:] == 0).all() and not mask[end - 1:].any()  # padding, no loss
        text = tokens[:end] < source.text_vocab_size
        assert torch.equal(mask[:end - 1].bool(), text[1:])  # predict only text tokens
        assert torch.equal(labels[:end - 1][mask[:end - 1].bool()], tokens[1:end][text[1:]])


def test_encoder_micro_batch_size_follows_the_dp_ratio_or_names_the_flags():
    assert encoder_micro_batch_size(_layout(4, 2), "vision", 2) == 1
    assert encoder_micro_batch_size(_layout(1, 2), "vision", 2) == 4
    with pytest.raises(LayoutError, match="--micro-batch-size 1 x --grid language: dp=2 = 2"):
        encoder_micro_batch_size(_layout(4, 2), "vision", 1)


def _guard_sums(layout: ParallelLayout, keys_of: dict[tuple[str, int], list[tuple[list, dict]]]
                ) -> tuple[torch.Tensor, list[AlignmentGuard]]:
    """Each (module, dp rank)'s guard fed its keys and item token counts per microbatch; the
    all-reduced sums."""
    guards = []
    total = None
    for (module, dp_rank), microbatches in keys_of.items():
        this = RankSlice.of(layout, module, dp_rank, 2)
        guard = AlignmentGuard(layout, module, this, True)
        for keys, counts in microbatches:
            guard.record(keys, this.positions, counts)
        part = guard.contribution()
        total = part if total is None else total + part
        guards.append(guard)
    return total, guards


@pytest.mark.parametrize("encoder_dp, language_dp", [(1, 2), (2, 1), (1, 1)])
def test_guard_sums_vanish_when_aligned_and_not_when_a_sample_moves(encoder_dp, language_dp):
    layout = _layout(encoder_dp, language_dp)
    streams = {(m, r): stream for m in ("vision", "audio", LANGUAGE)
               for r, stream in enumerate(_streams(layout, m))}
    keys_of = {rank: [(keys, batch[ITEM_TOKENS]) for keys, batch in
                      (next(stream) for _ in range(3))] for rank, stream in streams.items()}
    total, _ = _guard_sums(layout, keys_of)
    assert total.shape == (2 * language_dp,) and not total.any()
    late = keys_of[("vision", 0)]  # one microbatch late: every key lands in the wrong step slot
    total, _ = _guard_sums(layout, {**keys_of, ("vision", 0): late[1:] + late[:1]})
    assert total[:language_dp].any() and not total[language_dp:].any()  # vision only


def test_misalignment_message_names_both_ranks_and_the_first_differing_key():
    layout = _layout(1, 1)
    vision = {"vision": [(4,), ()]}
    both = {**vision, "audio": [(), ()]}
    held = {("vision", 0): [(["train/0", "train/1"], vision)],
            (LANGUAGE, 0): [(["train/0", "train/2"], both)]}
    total, guards = _guard_sums(layout, held)
    witnesses = [(0, "vision", 0, guards[0]._step_held), (2, LANGUAGE, 0, guards[1]._step_held)]
    message = _first_difference(witnesses, total, ["vision", "audio"], 1)
    assert "encoder 'vision' dp rank 0 (global rank 0) embedded sample 'train/1'" in message
    assert "language global rank 2 holds 'train/2'" in message


def test_the_guard_fires_when_an_encoder_counts_a_samples_items_otherwise():
    layout = _layout(1, 1)
    keys = ["train/0", "train/1"]
    language = {"vision": [(4,), (4, 4)], "audio": [(), (4,)]}
    held = {("vision", 0): [(keys, {"vision": [(4,), (4, 4)]})],
            ("audio", 0): [(keys, {"audio": [(), (4,)]})], (LANGUAGE, 0): [(keys, language)]}
    total, _ = _guard_sums(layout, held)
    assert not total.any()
    held[("vision", 0)] = [(keys, {"vision": [(4,), (4,)]})]  # one image of train/1 lost
    total, guards = _guard_sums(layout, held)
    assert total[0] != 0 and total[1] == 0
    witnesses = [(0, "vision", 0, guards[0]._step_held), (2, LANGUAGE, 0, guards[2]._step_held)]
    message = _first_difference(witnesses, total, ["vision", "audio"], 1)
    assert message.endswith("embedded sample 'train/1' as items of [4] tokens, but language "
                            "global rank 2 laid out runs of [4, 4]")


class _Group:
    """A process group as the data path reads it: only this rank's index."""

    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _rank_topology(layout: ParallelLayout, rank: int) -> SimpleNamespace:
    """What the data path reads of a live topology, for one global rank of ``layout`` (its
    modules in layout order, as build_topology lists them)."""
    modules = [m for m in layout.modules if m in layout.modules_of_rank(rank)]
    module_pgs = {m.name: SimpleNamespace(**{dim: _Group(m.coordinates(rank)[dim])
                                             for dim in ("tp", "cp", "dp", "pp")})
                  for m in modules}
    return SimpleNamespace(layout=layout, active_modules=tuple(module_pgs), module_pgs=module_pgs)


def _cp_layout(language_cp: int) -> ParallelLayout:
    return ParallelLayout((
        ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0, provider="vit"),
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=2, provider="audio"),
        ModulePlacement(name=LANGUAGE, tp=2, pp=2, cp=language_cp, dp=2, rank_offset=3),
    ))


def _args(pack: bool = False, load: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(micro_batch_size=2, balance_encoder_work=False, load=load, iteration=0,
                           consumed_train_samples=0, consumed_valid_samples=0,
                           pack_sequences=pack, train_iters=None)


def _first_train_batches(layout: ParallelLayout, source: MockSource, pack: bool = False):
    """Per global rank: (module, dp rank, its guard after one microbatch, that batch)."""
    args = _args(pack)
    ranks = []
    for rank in range(layout.world_size):
        topology = _rank_topology(layout, rank)
        guards = alignment_guard(topology, args.micro_batch_size)
        train, _, _ = data_provider(source, topology, guards, lambda: args)(None)
        [module] = topology.active_modules
        ranks.append((module, topology.module_pgs[module].dp.rank(), guards[module], next(train)))
    return ranks


@pytest.mark.parametrize("language_cp", [1, 2])
def test_each_replica_has_one_witness_and_the_guard_balances_under_context_parallelism(
        language_cp):
    """Every CP rank of a language replica holds the replica's whole microbatch; only CP rank 0
    (of tp rank 0, first stage) speaks for it, else the guard subtracts its keys cp times."""
    layout = _cp_layout(language_cp)
    witnesses: dict[tuple[str, int], int] = {}
    total = None
    for module, dp_rank, guard, _ in _first_train_batches(layout, _source(layout)):
        part = guard.contribution()
        witnesses[module, dp_rank] = witnesses.get((module, dp_rank), 0) + int(part.any())
        total = part if total is None else total + part
    assert witnesses == {("vision", 0): 1, ("vision", 1): 1, ("audio", 0): 1,
                         (LANGUAGE, 0): 1, (LANGUAGE, 1): 1}
    assert not total.any()


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_language_batches_have_no_dense_mask_with_or_without_context_parallelism(pack):
    layout = _cp_layout(2)
    batches = [batch for module, _, _, batch in
               _first_train_batches(layout, _source(layout, seq_length=64), pack)
               if module == LANGUAGE]
    assert len(batches) == 16
    for batch in batches:
        assert "attention_mask" not in batch  # MimoModel refuses a dense mask under CP
        assert batch["tokens"].shape == ((1, 64) if pack else (2, 64))
    if pack:
        kwargs = batches[0]["packing_kwargs"]
        padded = kwargs["cu_seqlens_q_padded"]
        assert padded[-1] == 64 and not (padded % 4).any()  # every sample padded to 2 x cp
        assert torch.equal(kwargs["cu_seqlens_kv_padded"], padded)
        real, room = torch.diff(kwargs["cu_seqlens_q"]), torch.diff(padded)
        assert real[-1] == 0 and room[-1] > 0  # the trailing padding: a segment of no tokens
        assert ((0 <= room - real) & (room - real < 4))[:-1].all()
        assert kwargs["max_seqlen_q"] == int(torch.diff(padded).max())
    unsplit = _cp_layout(1)
    [kept] = [batch for module, dp, _, batch in _first_train_batches(unsplit, _source(unsplit))
              if module == LANGUAGE][:1]
    assert "attention_mask" not in kept  # the causal mask type needs none: no s x s bytes per row


def _colocated_layout(vision_tp: int) -> ParallelLayout:
    """Audio on rank 0; vision ``tp=vision_tp, dp=2/vision_tp`` on the language's ranks 1-2."""
    return ParallelLayout((
        ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="audio"),
        ModulePlacement(name="vision", tp=vision_tp, pp=1, cp=1, dp=2 // vision_tp, rank_offset=1,
                        provider="vit", host=LANGUAGE),
        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=2, rank_offset=1),
    ))


def _same(one, other) -> bool:
    """Equal batches: the same keys, nesting and tensor values."""
    if isinstance(one, torch.Tensor):
        return isinstance(other, torch.Tensor) and torch.equal(one, other)
    if isinstance(one, dict):
        return (isinstance(other, dict) and one.keys() == other.keys()
                and all(_same(one[key], other[key]) for key in one))
    if isinstance(one, (list, tuple)):
        return (type(one) is type(other) and len(one) == len(other)
                and all(_same(a, b) for a, b in zip(one, other)))
    return one == other


@pytest.mark.parametrize("vision_tp, vision_positions", [(1, [[0, 1], [2, 3]]),
                                                         (2, [[0, 1, 2, 3], [0, 1, 2, 3]])],
                         ids=["vision-dp2", "vision-tp2"])
def test_a_colocated_rank_reads_its_language_replicas_batch_and_its_encoder_replicas(
        vision_tp, vision_positions):
    """With vision tp=2 rank 2 is vision replica 0 (positions 0-3) but language replica 1
    (positions 2-3): each module's batch follows its own replica, not the other's."""
    layout = _colocated_layout(vision_tp)
    source, args = _source(layout), _args()
    for rank, positions in zip((1, 2), vision_positions):
        topology = _rank_topology(layout, rank)
        assert topology.active_modules == ("vision", LANGUAGE)
        guards = alignment_guard(topology, args.micro_batch_size)
        assert guards.modules == ("vision", LANGUAGE)
        train, valid, _ = data_provider(source, topology, guards, lambda: args)(None)
        assert isinstance(train, ColocatedStream) and isinstance(valid, ColocatedStream)
        language_slice = rank_slice(topology, LANGUAGE, 2)
        vision_slice = rank_slice(topology, "vision", 2)
        assert (language_slice.dp_rank, list(language_slice.positions)) == (
            rank - 1, [2 * rank - 2, 2 * rank - 1])
        assert list(vision_slice.positions) == positions
        alone = _source(layout).open("train", vision_slice, 0)  # vision on its own ranks
        for step in range(2):  # the second microbatch starts one global batch (4) later
            batch = next(train)
            keys, expected = next(alone)
            assert expected.pop("positions") == positions
            assert keys == [f"train/{4 * step + p}" for p in positions]
            assert set(batch[COLOCATED]) == {"vision"}
            assert _same(batch[COLOCATED]["vision"], expected)
            for row, position in enumerate(language_slice.positions):
                text = source.text("train", 4 * step + position)
                assert torch.equal(batch["tokens"][row], text["tokens"])
            assert batch[ITEM_TOKENS]["vision"] == [
                tuple(source.item_tokens("train", 4 * step + p)["vision"])
                for p in language_slice.positions]


def _recorded_guards(layout: ParallelLayout, swapped: tuple[int, str] | None = None) -> dict:
    """Every rank's guards after one microbatch of the keys at each module's positions (with
    ``swapped``, that (rank, module) records its keys in reverse order)."""
    source = _source(layout)
    encoders = [m.name for m in layout.encoders]
    world = {}
    for rank in range(layout.world_size):
        topology = _rank_topology(layout, rank)
        guards = world[rank] = alignment_guard(topology, 2)
        for module in guards.modules:
            positions = list(rank_slice(topology, module, 2).positions)
            keys = [f"train/{p}" for p in positions]
            counts = {name: [tuple(source.item_tokens("train", p)[name]) for p in positions]
                      for name in (encoders if module == LANGUAGE else [module])}
            guards[module].record(keys[::-1] if (rank, module) == swapped else keys,
                                  positions, counts)
    return world


def _check_everywhere(world: dict, monkeypatch) -> list[str]:
    """The step's all-reduce of every rank's contribution, then each rank's check against a
    stand-in all_gather_object; the messages the ranks raise."""
    parts = [guards.contribution().tolist() for guards in world.values()]
    reduced = torch.tensor([addressing._as_int64(sum(column)) for column in zip(*parts)])
    gathered = [[(rank, *guards[m].witness_records()) for m in guards.modules]
                for rank, guards in world.items()]
    messages = []
    for rank, guards in world.items():
        def all_gather_object(out, mine, rank=rank):
            assert mine == gathered[rank]
            out[:] = gathered

        monkeypatch.setattr(addressing, "dist", SimpleNamespace(
            get_rank=lambda rank=rank: rank, get_world_size=lambda: len(world),
            all_gather_object=all_gather_object))
        try:
            guards.check(reduced)
        except DataMisalignmentError as error:
            messages.append(str(error))
    return messages


@pytest.mark.parametrize("layout, swapped, message", [
    (_colocated_layout(1), (1, "vision"), "encoder 'vision' dp rank 0 (global rank 1) embedded "
     "sample 'train/1' at position 0, but language global rank 1 holds 'train/0' there"),
    (_colocated_layout(2), (1, "vision"), "encoder 'vision' dp rank 0 (global rank 1) embedded "
     "sample 'train/3' at position 0, but language global rank 1 holds 'train/0' there"),
    (_colocated_layout(2), (2, LANGUAGE), "encoder 'audio' dp rank 0 (global rank 0) embedded "
     "sample 'train/2' at position 2, but language global rank 2 holds 'train/3' there"),
    (_layout(1, 1), (0, "vision"), "encoder 'vision' dp rank 0 (global rank 0) embedded "
     "sample 'train/1' at position 0, but language global rank 2 holds 'train/0' there"),
], ids=["colocated-dp2", "colocated-tp2-encoder", "colocated-tp2-language", "disjoint"])
def test_guard_sets_check_clean_when_aligned_and_name_a_swapped_sample_on_every_rank(
        layout, swapped, message, monkeypatch):
    assert _check_everywhere(_recorded_guards(layout), monkeypatch) == []
    world = _recorded_guards(layout, swapped)
    assert _check_everywhere(world, monkeypatch) == [
        f"data misalignment at microbatch 0 of this step: {message}"] * len(world)


class _Saving:
    """A mock stream with a loader state naming its slice."""

    def __init__(self, inner, rank_slice: RankSlice) -> None:
        self._inner = inner
        self._state = {"module": rank_slice.module, "dp": rank_slice.dp_rank}

    def __next__(self):
        return next(self._inner)

    def state_dict(self) -> dict:
        return self._state


class _SavingSource:
    """The mock source with a loader state per opened stream; no ``test`` split."""

    def __init__(self, source: MockSource) -> None:
        self._source = source
        self.special_token_ids = source.special_token_ids

    def open(self, split, rank_slice, start, resume):
        if split == "test":
            return None
        return _Saving(self._source.open(split, rank_slice, start, resume), rank_slice)


@pytest.mark.parametrize("vision_tp, files", [
    (1, {1: ["language_dp000.pt", "vision_dp000.pt"], 2: ["language_dp001.pt", "vision_dp001.pt"]}),
    (2, {1: ["language_dp000.pt", "vision_dp000.pt"], 2: ["language_dp001.pt"]}),
], ids=["vision-dp2", "vision-tp2"])
def test_a_colocated_rank_saves_each_witnessed_modules_loader_state(vision_tp, files, tmp_path):
    """Vision tp rank 1 does not speak for its replica: rank 2 of vision tp=2 saves only the
    language's state; a split the source lacks stays None."""
    layout = _colocated_layout(vision_tp)
    for rank, names in files.items():
        topology = _rank_topology(layout, rank)
        train, _, test = data_provider(_SavingSource(_source(layout)), topology, None,
                                       _args)(None)
        assert test is None and set(next(train)[COLOCATED]) == {"vision"}
        train.save_data_state(tmp_path / str(rank))
        saved = sorted((tmp_path / str(rank) / "dataloader").iterdir())
        assert [path.name for path in saved] == names
        for path in saved:
            module, dp = path.stem.split("_dp")
            assert torch.load(path) == {"module": module, "dp": int(dp)}


def test_the_mock_source_opened_for_two_modules_in_one_process_reads_as_in_two():
    layout = _colocated_layout(2)
    shared = _source(layout)
    vision_slice, language_slice = (RankSlice.of(layout, "vision", 0, 2),
                                    RankSlice.of(layout, LANGUAGE, 1, 2))
    together = [shared.open("train", vision_slice, 8), shared.open("train", language_slice, 8)]
    apart = [_source(layout).open("train", vision_slice, 8),
             _source(layout).open("train", language_slice, 8)]
    for _ in range(3):
        for one, other in zip(together, apart):
            assert _same(next(one), next(other))
