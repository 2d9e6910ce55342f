"""Tiny random HF causal LMs on disk and their reference logits, for the HF weights tests.

Models are made offline from configs and saved with safetensors. Every weight, norms included, is
redrawn so a mapping that swaps or misses a tensor changes the logits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPE = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 24, "norm_topk_prob": True}),
    "dots1": ("Dots1Config", "Dots1ForCausalLM",
              {"head_dim": 16, "num_hidden_layers": 3, "first_k_dense_replace": 1,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "moe_intermediate_size": 24, "norm_topk_prob": True,
               "routed_scaling_factor": 2.5}),
}
TOKENS = torch.tensor([[3, 17, 42, 99, 5, 8, 61, 23, 0, 77, 12, 34],
                       [50, 1, 2, 98, 44, 31, 7, 7, 64, 19, 88, 26]])


def redraw_parameters(model: torch.nn.Module) -> None:
    """Every parameter redrawn from the current seed: norms around 1, the rest small."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))


def save_tiny(family: str, folder: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32,
              **overrides: Any) -> Path:
    """A tiny random ``family`` model saved to ``folder`` (safetensors, config.json); another
    ``dtype`` goes through transformers' own loading, which keeps its fp32 modules (dots1's
    router expert bias) in fp32."""
    import tempfile

    import transformers

    config_name, model_name, extra = FAMILY_CLASSES[family]
    config = getattr(transformers, config_name)(**{**SHAPE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    redraw_parameters(model)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in model.state_dict().items():
            if name not in params:  # a persistent buffer (the expert bias): non-zero too
                tensor.copy_(0.1 * torch.randn_like(tensor))
    if dtype == torch.float32:
        model.save_pretrained(folder)
        return Path(folder)
    with tempfile.TemporaryDirectory() as fp32:
        model.save_pretrained(fp32)
        getattr(transformers, model_name).from_pretrained(fp32, dtype=dtype).save_pretrained(folder)
    return Path(folder)


def hf_logits(folder: str | Path, tokens: torch.Tensor = TOKENS) -> np.ndarray:
    """transformers' own forward of the saved model, fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits.float().numpy()


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Max absolute difference relative to the largest reference magnitude."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def stock_args(argv: list[str]) -> Any:
    """Stock Megatron args for ``argv`` plus ``--language-hf-weights``' shape (nothing given
    contradicts it here), validated."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_plugins.weights.flags import add_weights_args, implied_language_args

    saved, sys.argv = sys.argv, ["test", *argv]
    try:
        args = parse_args(add_weights_args)
    finally:
        sys.argv = saved
    for attr, value in implied_language_args(args, lambda attr: None)[1].items():
        setattr(args, attr, value)
    validate_args(args)
    return args


BASE_FLAGS = ["--seq-length", "12", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local",
              "--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0",
              "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
              "--no-rope-fusion", "--no-persist-layer-norm", "--distributed-backend", "gloo",
              "--seed", "1234"]
"""Stock flags for a stock GPT built from a HF folder: no shape flag (config.json gives them).
Stock's bias-SwiGLU and bias-dropout-add fusions stay on, as on a GPU (they run eagerly here)."""


def stock_gpt_rank(folder: str, tp: int, pp: int, extra: list[str]) -> dict[str, Any]:
    """One rank of a stock GPT (TP x PP) built by our language builder from ``folder``'s config,
    HF weights imported; returns the full-vocabulary logits on the last stage."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron.core import parallel_state
    from megatron.training.global_vars import unset_global_variables

    try:
        return _stock_gpt(folder, tp, pp, extra)
    finally:
        parallel_state.destroy_model_parallel()
        unset_global_variables()


def import_errors(cases: list[tuple[str, list[str]]]) -> list[str]:
    """The one-line error each (folder, extra flags) import raises, on one rank ("" if none)."""
    from megatron_plugins.errors import UsageError

    errors = []
    for folder, extra in cases:
        try:
            stock_gpt_rank(folder, 1, 1, extra)
            errors.append("")
        except UsageError as error:
            errors.append(str(error))
    return errors


def _stock_gpt(folder: str, tp: int, pp: int, extra: list[str]) -> dict[str, Any]:
    from megatron_plugins.weights.hf_import import load_hf_weights
    from megatron_plugins.weights.language_families import FAMILIES

    model, pgc, args = build_stock_gpt(folder, tp, pp, extra)
    family = load_hf_weights(model, folder, "--language-hf-weights", pgc, FAMILIES)
    logits = forward_logits(model, pgc, TOKENS)
    return {"family": family.name, "logits": logits, "padded_vocab": args.padded_vocab_size}


def build_stock_gpt(folder: str, tp: int, pp: int, extra: list[str]) -> tuple[Any, Any, Any]:
    """This rank's stock GPT shaped by ``folder``'s config.json (weights not loaded):
    (model, process groups, args). Needs torch.distributed and the CPU simulation."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.global_vars import set_global_variables

    from megatron_plugins.model.language import StockLanguageModel, language_config_from_args

    args = stock_args([*BASE_FLAGS, "--tensor-model-parallel-size", str(tp),
                       "--pipeline-model-parallel-size", str(pp),
                       "--language-hf-weights", folder, *extra])
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    set_global_variables(args, build_tokenizer=False)
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    config = language_config_from_args(args)
    return StockLanguageModel(config.transformer, config, pgc, args.seq_length), pgc, args


def forward_logits(model: Any, pgc: Any, tokens: torch.Tensor) -> np.ndarray | None:
    """The language model's logits over its TP x PP ranks (hidden states sent stage to stage);
    the full padded vocabulary on the last stage, None elsewhere."""
    import torch.distributed as dist

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    pp_rank = pgc.pp.rank()
    ranks = dist.get_process_group_ranks(pgc.pp)
    hidden_shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if pp_rank > 0:
            received = torch.empty(hidden_shape)
            dist.recv(received, src=ranks[pp_rank - 1], group=pgc.pp)
            model.set_input_tensor(received)
        return hand_on(model(tokens, positions, None), pgc)


def hand_on(output: torch.Tensor, pgc: Any) -> np.ndarray | None:
    """A pipeline stage's output: sent to the next stage (None returned), or on the last stage
    the logits gathered over TP (the full padded vocabulary)."""
    import torch.distributed as dist

    stage, ranks = pgc.pp.rank(), dist.get_process_group_ranks(pgc.pp)
    if stage < len(ranks) - 1:
        dist.send(output.contiguous(), dst=ranks[stage + 1], group=pgc.pp)
        return None
    shards = [torch.empty_like(output) for _ in range(pgc.tp.size())]
    dist.all_gather(shards, output.contiguous(), group=pgc.tp)
    return torch.cat(shards, dim=-1).float().numpy()


MIMO_FLAGS = [*BASE_FLAGS, "--global-batch-size", "4", "--train-iters", "4", "--eval-interval",
              "2", "--eval-iters", "1", "--log-interval", "1", "--min-lr", "1e-4",
              "--lr-decay-style", "cosine", "--num-workers", "0", "--cpu-simulation"]
"""An encoder (e.g. :data:`VIT`) on the first ranks, the language model (``--grid language:...``)
after it; no shape flags."""
VIT = ("--encoder", "vision=vit", "--grid", "vision:dp=1")


def built_then(argv: list[str], after: Any) -> dict[str, Any]:
    """Build one rank of a MiMo model through the entry point's code path (HF weights loaded by
    the builder, no DDP) and return ``after(session, model)`` with the rank's ``module``."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.compat import startup
    from megatron_plugins.launch.pretrain import parse_mimo_args, start

    startup.install()
    session = start(parse_mimo_args(argv))
    try:
        builder = session.config.model.get_builder_cls()(session.config.model)
        [mimo] = builder.build_distributed_models(wrap_with_ddp=False)
        [module] = ["language"] if session.topology.hosted else session.topology.active_modules
        return {"module": module, **after(session, mimo)}
    finally:
        session.close()


def _language_logits(session: Any, mimo: Any) -> dict[str, Any]:
    from megatron_plugins.weights.language_families import FAMILIES
    from megatron_plugins.weights.local_view import unwrap

    [module] = session.topology.active_modules
    if module != "language":
        return {}
    pgc = session.topology.module_pgs[module]
    language = unwrap(mimo.language_model)
    [family] = [f for f in FAMILIES if f.name == session.run.args.language_hf_family]
    return {"logits": forward_logits(language, pgc, TOKENS),
            "pieces": streamed(language, family, pgc, session.run.args.vocab_size)}


def mimo_language_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of a MiMo model built with HF weights: the language model's logits on its last
    stage and its streamed pieces."""
    return built_then(argv, _language_logits)


def streamed(module: Any, family: Any, pgc: Any, vocab_size: int) -> bytes:
    """This rank's streamed pieces, serialized (torch's shared-memory pickling of tensors does
    not outlive the worker)."""
    import io

    from megatron_plugins.weights.streaming import iter_hf_weights

    buffer = io.BytesIO()
    torch.save(list(iter_hf_weights(module, family, pgc, vocab_size)), buffer)
    return buffer.getvalue()


def pieces_from(data: bytes) -> list[Any]:
    """The pieces :func:`streamed` serialized."""
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def mimo_import(nproc: int, folder: str, language_grid: str, extra: tuple[str, ...] = ()
                ) -> tuple[list[np.ndarray], list[list[Any]]]:
    """A MiMo model built from ``folder``: the logits of every language last-stage rank and the
    streamed pieces of every language rank."""
    from tests.harness.multiprocess import run_in_processes

    argv = [*MIMO_FLAGS, *VIT, "--grid", language_grid, "--language-hf-weights", folder, *extra]
    results = run_in_processes(mimo_language_rank, nproc, args=(argv,), timeout=120,
                               simulated=True)
    language = [r for r in results if r["module"] == "language"]
    return ([r["logits"] for r in language if r["logits"] is not None],
            [pieces_from(r["pieces"]) for r in language])


def safetensors_of(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF folder's safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def train_then(argv: list[str], after: Any) -> dict[str, Any]:
    """One rank of a MiMo training run (stock ``pretrain()``); ``after(session, model)`` runs on
    the trained model before teardown and its dict comes back with the rank's ``module``."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()
    from megatron_plugins.launch.pretrain import parse_mimo_args, train

    result: dict[str, Any] = {}

    def observe(session: Any) -> None:
        # The module whose own ranks these are (a rank hosting an encoder is a language rank).
        result["module"] = session.topology.layout.module_of_rank(
            torch.distributed.get_rank()).name
        models: list[Any] = []
        session.config.model.post_wrap_hooks.append(lambda chunks: models.extend(chunks) or chunks)
        close = session.close

        def after_then_close() -> None:
            result.update(after(session, models[0]))
            close()

        session.close = after_then_close

    train(parse_mimo_args(argv), observe)
    return result


def _stream_trained(session: Any, model: Any) -> dict[str, Any]:
    """Language ranks: streamed pieces and logits; encoder ranks with an HF mapping: pieces."""
    from megatron_plugins.weights.encoder_view import encoder_module
    from megatron_plugins.weights.flags import encoder_family
    from megatron_plugins.weights.language_families import FAMILIES
    from megatron_plugins.weights.local_view import unwrap

    [module] = session.topology.active_modules
    args, pgc = session.run.args, session.topology.module_pgs[module]
    if module == "language":
        [family] = [f for f in FAMILIES if f.name == args.language_hf_family]
        language = unwrap(model.language_model)
        return {"pieces": streamed(language, family, pgc, args.vocab_size),
                "logits": forward_logits(language, pgc, TOKENS)}
    family = encoder_family(session.run.plugins[module])
    if family is not None:
        network = encoder_module(unwrap(model.modality_submodules[module]), module, family)
        return {"pieces": streamed(network, family, pgc, None)}
    return {}


def train_and_stream_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of a MiMo training run started from HF weights; language ranks return their
    streamed pieces of the trained model and its logits."""
    return train_then(argv, _stream_trained)


def train_from_hf(nproc: int, folder: str, language_grid: str, extra: tuple[str, ...] = (),
                  module: str = "language", encoder: tuple[str, ...] = VIT
                  ) -> tuple[list[list[Any]], np.ndarray]:
    """Train a MiMo model started from ``folder``: the streamed pieces of every rank of
    ``module`` (the language model, or an encoder with an HF mapping) and the trained language
    model's logits."""
    from tests.harness.multiprocess import run_in_processes

    argv = [*MIMO_FLAGS, *encoder, "--grid", language_grid, "--language-hf-weights", folder,
            *extra]
    results = run_in_processes(train_and_stream_rank, nproc, args=(argv,), timeout=180,
                               simulated=True)
    logits = next(r["logits"] for r in results if r.get("logits") is not None)
    return [pieces_from(r["pieces"]) for r in results if r["module"] == module], logits


def export_rank(jobs: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Run ``tools.export_hf.export(checkpoint, output, **options)`` for each job, in one process."""
    from tools.export_hf import export

    for checkpoint, output, options in jobs:
        export(checkpoint, output, **options)


def export_checkpoints(jobs: list[tuple[str, str, dict[str, Any]]], timeout: float = 120) -> None:
    """:func:`export_rank` in one process forked from the simulated ranks' server, which has
    Megatron imported already (a fresh interpreter spends ~14 s of CPU importing it first);
    ``test_hf_export`` runs the tool in a fresh interpreter, as users do."""
    from tests.harness.multiprocess import run_in_processes

    run_in_processes(export_rank, 1, args=(jobs,), timeout=timeout, simulated=True)
