"""A tiny random HF LLaVA on disk, transformers' logits on a multi-image sample, and the same
sample through our MiMo model built with ``--hf-model`` (encoder and language on their grids).

The model is made offline from configs; every weight is redrawn so a mapping that swaps or misses
a tensor changes the logits. The mock data marks the encoder's positions with the checkpoint's
image token (here the vocabulary's top id), so a training run on it feeds images where HF does.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.models.hf import MIMO_FLAGS, built_then, hand_on, pieces_from, train_then
from tests.models.hf_vision import SHAPE as VISION
from tests.models.hf_vision import redraw

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = dict(vocab_size=100, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
IMAGE_TOKEN = TEXT["vocab_size"] - 1
PATCHES = (VISION["image_size"] // VISION["patch_size"]) ** 2
ENCODER = "image"


LAYOUTS = {"one-rank-per-module": (("image:dp=1", "language:dp=1"), 2),
           "encoder-tp2-language-pp2": (("image:tp=2", "language:pp=2"), 4)}
"""The whole-VLM acceptance layouts: (``--grid`` values, ranks), by test id."""


def save_tiny_llava(folder: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random ``LlavaForConditionalGeneration`` (CLIP tower of 2 layers, Llama of 2)."""
    import transformers

    vision = {**VISION, **overrides.pop("vision", {})}
    text = {**TEXT, **overrides.pop("text", {})}
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision),
        text_config=transformers.LlamaConfig(**text), image_token_index=IMAGE_TOKEN,
        **overrides)
    torch.manual_seed(seed)
    model = redraw(transformers.LlavaForConditionalGeneration(config))
    model.save_pretrained(folder)
    return Path(folder)


def sample(tokens_per_image: int = PATCHES, seed: int = 2) -> tuple[torch.Tensor, np.ndarray]:
    """One sample of two images and text (``[1, S]`` ids, placeholders where HF puts image
    features) and its two images' pixel values."""
    run = [IMAGE_TOKEN] * tokens_per_image
    ids = torch.tensor([[5, 17, *run, 42, 8, 61, *run, 23, 3, 77]])
    pixels = np.random.default_rng(seed).normal(size=(2, 3, 16, 16)).astype(np.float32)
    return ids, pixels


def hf_llava_logits(folder: str | Path, ids: torch.Tensor, pixels: np.ndarray) -> np.ndarray:
    """transformers' own forward of the saved LLaVA, fp32."""
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder,
                                                                       dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=torch.from_numpy(pixels)).logits.numpy()


def vlm_flags(folder: str | Path, grids: tuple[str, ...]) -> list[str]:
    """A MiMo launch from the whole LLaVA folder; no encoder, shape or weights flags."""
    return [*MIMO_FLAGS, "--seq-length", "64", "--hf-model", str(folder),
            *(part for grid in grids for part in ("--grid", grid))]


def cross_grid_forward(mimo: Any, module: str, topology: Any, ids: torch.Tensor,
                       inputs: dict[str, torch.Tensor], tokens: int,
                       positions: torch.Tensor | None = None,
                       levels: int = 0) -> np.ndarray | None:
    """One forward over the grids: the encoder's TP rank 0 sends its projected features (of
    ``tokens`` positions, from its forward ``inputs``) to every language rank, which the first
    stage's (each TP and data-parallel rank of it) take as input, the stages
    pass hidden states on, the last returns full logits. ``positions``: consecutive unless
    given (``[3, 1, S]`` under multimodal RoPE); ``levels``: the encoder's DeepStack levels
    (its rows are ``1 + levels`` language hidden sizes wide)."""
    import torch.distributed as dist

    pgc = topology.module_pgs[module]
    length = ids.shape[1]
    positions = torch.arange(length).unsqueeze(0) if positions is None else positions
    mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1).expand(1, 1, length, length)
    grid = topology.grids["language"]
    with torch.no_grad():
        if module != "language":
            outputs, _ = mimo(input_ids=ids, modality_inputs={module: {module: inputs}})
            if pgc.tp.rank() == 0:
                for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
                    dist.send(outputs[module].contiguous(), dst=rank)
            return None
        stage = pgc.pp.rank()
        stage_ranks = dist.get_process_group_ranks(pgc.pp)
        hidden = mimo.language_model.config.hidden_size
        features = torch.empty(tokens, (1 + levels) * hidden)
        dist.recv(features, src=topology.grids[ENCODER].rank_offset)
        if stage == 0:
            mimo.set_input_tensor({ENCODER: features})
        else:
            received = torch.empty(length, 1, hidden)
            dist.recv(received, src=stage_ranks[stage - 1], group=pgc.pp)
            mimo.set_input_tensor({"language": received})
        output, _ = mimo(input_ids=ids, position_ids=positions, attention_mask=mask)
        if isinstance(output, dict):  # a stage before the last hands on its hidden states
            output = output["language"]
        return hand_on(output, pgc)


def _forward_and_stream(session: Any, mimo: Any, ids: torch.Tensor, pixels: np.ndarray
                        ) -> dict[str, Any]:
    [module] = session.topology.active_modules
    mimo.eval()
    plugin = session.run.plugins[ENCODER]
    logits = cross_grid_forward(mimo, module, session.topology, ids,
                                {"x": torch.from_numpy(pixels)}, 2 * plugin.tokens_per_item)
    return {"logits": logits, "pieces": whole_pieces(mimo, session),
            "special_token_ids": dict(mimo.special_token_ids),
            "tokens_per_item": plugin.tokens_per_item, "layers": plugin.layers}


def vlm_forward_rank(argv: list[str], ids: torch.Tensor, pixels: np.ndarray) -> dict[str, Any]:
    """One rank of a MiMo model built from ``--hf-model`` through the entry point's code path:
    its module, the logits on the language's last stage, and its streamed HF pieces."""
    return built_then(argv, functools.partial(_forward_and_stream, ids=ids, pixels=pixels))


def vlm_forward(nproc: int, folder: str | Path, grids: tuple[str, ...], ids: torch.Tensor,
                pixels: np.ndarray) -> list[dict[str, Any]]:
    """:func:`vlm_forward_rank` on ``nproc`` gloo ranks; pieces deserialized."""
    from tests.harness.multiprocess import run_in_processes

    results = run_in_processes(vlm_forward_rank, nproc, args=(vlm_flags(folder, grids), ids,
                                                               pixels),
                               timeout=180, simulated=True)
    for result in results:
        result["pieces"] = pieces_from(result["pieces"])
    return results


def whole_pieces(mimo: Any, session: Any) -> bytes:
    """This rank's streamed pieces of the ``--hf-model`` folder (of each module it runs: an
    encoder by its own provider's family, the language model by the vision tower's), serialized."""
    import io

    from megatron_plugins.weights.local_view import unwrap
    from megatron_plugins.weights.streaming import iter_whole_weights

    args, plugins = session.run.args, session.run.plugins
    buffer = io.BytesIO()
    torch.save([piece for module in session.topology.active_modules
                for piece in iter_whole_weights(unwrap(mimo), module,
                                                session.topology.module_pgs[module],
                                                args.hf_model,
                                                plugins.get(module, plugins[ENCODER]).hf_family,
                                                args.vocab_size)], buffer)
    return buffer.getvalue()


def _stream_whole(session: Any, model: Any) -> dict[str, Any]:
    return {"pieces": whole_pieces(model, session)}


def vlm_train_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of a MiMo training run (stock ``pretrain()``) from ``--hf-model``; returns its
    module and its streamed pieces of the trained model."""
    return train_then(argv, _stream_whole)


def vlm_train(nproc: int, folder: str | Path, grids: tuple[str, ...], extra: tuple[str, ...]
              ) -> list[list[Any]]:
    """Train from ``--hf-model`` on ``nproc`` gloo ranks; every rank's streamed pieces. The
    vocabulary is not padded, so the logged loss is transformers' softmax over the same ids."""
    from tests.harness.multiprocess import run_in_processes

    argv = [*vlm_flags(folder, grids), "--mock-items-per-sample", "1:2",
            "--make-vocab-size-divisible-by", "1", *extra]
    results = run_in_processes(vlm_train_rank, nproc, args=(argv,), timeout=240, simulated=True)
    return [pieces_from(result["pieces"]) for result in results]


REFERENCE = (("image:dp=1", "language:dp=1"), 2)
"""One rank per module of a one-tower VLM: (``--grid`` values, ranks)."""
RESAVED = (("image:tp=2", "language:pp=2"), 4)
"""Encoder TP 2 + language PP 2 of a one-tower VLM: (``--grid`` values, ranks)."""


def train_and_export(folder: str | Path, root: Path, extra: tuple[str, ...] = ()
                     ) -> list[list[Any]]:
    """Trained 2 steps on the mock data at one rank per module and saved under ``root/first``
    (its scalars in ``root/tensorboard``); the same weights re-saved at encoder TP 2 + language
    PP 2 (:func:`resave`) under ``root/second``; both exported to ``root/out_first``,
    ``root/out_second``. Returns the first run's streamed pieces of the trained model.
    ``extra``: flags of both runs."""
    pieces = vlm_train(REFERENCE[1], folder, REFERENCE[0], (
        *extra, "--train-iters", "2", "--save", str(root / "first"), "--save-interval", "2",
        "--tensorboard-dir", str(root / "tensorboard")))
    resave(folder, root, "second", RESAVED[1], RESAVED[0], extra)
    export(root, ("first", "second"))
    return pieces


def resave(folder: str | Path, root: Path, name: str, nproc: int, grids: tuple[str, ...],
           extra: tuple[str, ...] = ()) -> None:
    """The weights :func:`train_and_export` saved under ``root/first``, loaded at ``grids`` (one
    step at lr 0) and saved under ``root/name``."""
    vlm_train(nproc, folder, grids, (
        *extra, "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--load", str(root / "first"),
        "--finetune", "--no-load-optim", "--no-load-rng", "--save", str(root / name),
        "--save-interval", "1"))


def export(root: Path, names: tuple[str, ...]) -> None:
    """``tools/export_hf.py`` of each checkpoint ``root/name`` to ``root/out_name``."""
    from tests.models.hf import export_checkpoints

    export_checkpoints([(str(root / name), str(root / f"out_{name}"), {"progress": False})
                        for name in names])


def bad_input(argv: list[str], monkeypatch: Any, world_size: int = 2) -> str:
    """The one-line error ``parse_mimo_args`` raises before any process group."""
    import pytest

    from megatron_plugins.errors import UsageError
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(UsageError) as error:
        parse_mimo_args(argv)
    message = str(error.value)
    assert "\n" not in message
    return message


def edited(folder: Path, target: Path, config: dict[str, Any] | None = None,
           tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of ``folder`` with config.json fields and tensors replaced."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, target)
    if config:
        path = target / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        loaded = load_file(target / "model.safetensors")
        save_file({**loaded, **tensors}, str(target / "model.safetensors"),
                  metadata={"format": "pt"})
    return target


def built_forward(after: Any, nproc: int, argv: list[str]) -> list[dict[str, Any]]:
    """``built_then(argv, after)`` on ``nproc`` gloo ranks (``after`` a picklable function
    returning the rank's streamed ``pieces`` among its results); pieces deserialized."""
    from tests.harness.multiprocess import run_in_processes

    results = run_in_processes(built_then, nproc, args=(argv, after), timeout=240,
                               simulated=True)
    for result in results:
        result["pieces"] = pieces_from(result["pieces"])
    return results


def identical_exports(root: Path, other: str = "out_second") -> list[str]:
    """The files of ``root/out_first`` (sorted), each byte-identical in ``root/other``: the
    saving layouts of :func:`train_and_export` (or :func:`resave`) export one folder."""
    out = root / "out_first"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    for file in files:
        assert (out / file).read_bytes() == (root / other / file).read_bytes(), file
    return files


def check_export(out: Path, folder: Path, pieces: list[list[Any]], untrained: tuple[str, ...]
                 ) -> dict[str, torch.Tensor]:
    """The exported folder ``out`` has the source ``folder``'s config and tensor names, the
    trained tensors as the run streamed them (``pieces``) and the ``untrained`` ones (name
    prefixes) unchanged; returns its tensors."""
    from megatron_plugins.weights.streaming import assemble
    from tests.models.hf import safetensors_of

    assert json.loads((out / "config.json").read_text()) == json.loads(
        (folder / "config.json").read_text())
    written, original = safetensors_of(out), safetensors_of(folder)
    assert sorted(written) == sorted(original)
    streamed = assemble(piece for rank in pieces for piece in rank)
    for name, tensor in written.items():
        want = original[name] if name.startswith(untrained) else streamed[name]
        assert torch.equal(tensor, want), name
    return written


SGD_TRAIN = ("--optimizer", "sgd", "--lr", "0.05", "--min-lr", "0.005", "--train-iters", "3",
             "--eval-iters", "0")
"""Plain SGD (see test_mimo_layout_invariance: Adam would hide a wrongly scaled gradient)."""


def sgd_run(folder: str | Path, root: Path, name: str, nproc: int, grids: tuple[str, ...],
            extra: tuple[str, ...] = ()) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Per-iteration ``lm loss`` and every trained tensor of a short SGD run of ``folder``."""
    from megatron_plugins.weights.streaming import assemble
    from tests.harness.tensorboard_scalars import read_scalars

    pieces = vlm_train(nproc, folder, grids, (*SGD_TRAIN, "--tensorboard-dir", str(root / name),
                                              *extra))
    return read_scalars(root / name, "lm loss"), assemble(p for rank in pieces for p in rank)


def assert_trains_like(reference: tuple[dict[int, float], dict[str, torch.Tensor]],
                       run: tuple[dict[int, float], dict[str, torch.Tensor]], name: str) -> None:
    """:func:`sgd_run`'s results ``run`` are ``reference``'s: the same per-iteration losses
    (1e-5) and the same trained tensors."""
    import pytest

    assert sorted(reference[0]) == [1, 2, 3]
    assert run[0] == pytest.approx(reference[0], rel=1e-5), name
    assert run[1].keys() == reference[1].keys()
    losses = max(abs(run[0][i] - value) / abs(value) for i, value in reference[0].items())
    weights = max(float((run[1][k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                  for k, v in reference[1].items())
    print(f"{name}: max relative difference, lm loss {losses:.1e}, trained tensors {weights:.1e}")
    for key, value in reference[1].items():
        torch.testing.assert_close(run[1][key], value, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")


def assert_trains_identically(folder: str | Path, root: Path,
                              cases: tuple[tuple[str, int, tuple[str, ...], tuple[str, ...]], ...]
                              ) -> None:
    """Each case (name, ranks, ``--grid`` values, extra flags) trains ``folder`` as one rank per
    module does: the same per-iteration losses (1e-5) and the same trained tensors."""
    reference = sgd_run(folder, root, "reference", REFERENCE[1], REFERENCE[0])
    for name, nproc, grids, extra in cases:
        assert_trains_like(reference, sgd_run(folder, root, name, nproc, grids, extra), name)
