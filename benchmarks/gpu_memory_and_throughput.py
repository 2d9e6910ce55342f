"""GPU measurements that only CUDA shows: grad-buffer / optimizer-state bytes per parameter, and
bf16 throughput and peak memory of the built-in encoders. Results are in docs/gpu-measurements.md.

Run on one GPU (world size 1, single-rank NCCL group)::

    python benchmarks/gpu_memory_and_throughput.py [--section all|memory|encoders] [--json PATH]

``--smoke`` runs the same code paths with tiny sizes under the package's CPU simulation (no GPU;
every memory figure reads 0 there): it only checks that the script runs.

Part 1 builds a plain ``GPTModel`` (local spec, ~110M parameters) per precision setting and reads
``torch.cuda.memory_allocated`` around the DDP wrap, the optimizer's construction and its first
step (Adam states are created lazily at the first step). Part 2 builds each built-in encoder
through its plugin interface, wraps it in ``EncoderPrecisionWrapper`` and times forward+backward.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

GPT = dict(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=32768,
           seq_length=1024, micro_batch=2)
GPT_SMOKE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                 seq_length=32, micro_batch=2)
LANGUAGE_HIDDEN = 4096
VIT_FLAGS = ["--vit-num-layers", "24", "--vit-hidden-size", "1024",
             "--vit-num-attention-heads", "16", "--vit-img-size", "448", "--vit-patch-size", "14"]
AUDIO_FLAGS = ["--audio-num-layers", "4", "--audio-hidden-size", "1024",
               "--audio-num-attention-heads", "16", "--audio-num-frames", "3000",
               "--audio-num-features", "128"]
VIT_SMOKE = ["--vit-num-layers", "2", "--vit-hidden-size", "64", "--vit-num-attention-heads",
             "4", "--vit-img-size", "28", "--vit-patch-size", "14"]
AUDIO_SMOKE = ["--audio-num-layers", "1", "--audio-hidden-size", "64",
               "--audio-num-attention-heads", "4", "--audio-num-frames", "16",
               "--audio-num-features", "8"]

# (label, bf16, grad_reduce_in_fp32, use_distributed_optimizer, precision_aware)
SETTINGS = [
    ("a: fp32 params/grads, fp32 Adam", False, True, True, False),
    ("b: bf16 params, fp32 grad buffer, fp32 main params + moments", True, True, True, False),
    ("c: bf16 params, bf16 grad buffer (grad_reduce_in_fp32=False)", True, False, True, False),
    ("d: precision-aware optimizer (bf16 main grads, bf16 exp_avg/exp_avg_sq)",
     True, False, True, True),
    ("a': as (a), non-distributed optimizer", False, True, False, False),
    ("b': as (b), non-distributed optimizer", True, True, False, False),
    ("c': as (c), non-distributed optimizer", True, False, False, False),
]
# Megatron's distributed-optimizer doc, bytes/param at d = DP size = 1.
DOC_FORMULA = {
    "a": "8 + 8/d = 16", "b": "6 + 12/d = 18", "c": "4 + 16/d = 20 (fp16-style: fp32 main grads)",
    "d": "4 + 8/d = 12, or 4 + 6/d = 10 with param remainders",
    "a'": "16", "b'": "18", "c'": "20",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=["all", "memory", "encoders"], default="all")
    parser.add_argument("--json", default=None, help="Also write the results as JSON here.")
    parser.add_argument("--smoke", action="store_true",
                        help="Tiny sizes under the CPU simulation (code-path check only).")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    from megatron_plugins.cpu_simulation import patches

    patches.activate()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_plugins.compat import model_build  # noqa: E402
from megatron_plugins.encoders.audio import AudioFrameEncoder  # noqa: E402
from megatron_plugins.encoders.vit import ViTEncoder  # noqa: E402
from megatron_plugins.parallel.layout import ModulePlacement  # noqa: E402
from megatron_plugins.model.lifecycle import EncoderPrecisionWrapper  # noqa: E402

MiB = 2**20


def sync() -> None:
    torch.cuda.synchronize()


def mem() -> int:
    sync()
    return torch.cuda.memory_allocated()


def cleanup() -> None:
    gc.collect()
    buffer = parallel_state._GLOBAL_MEMORY_BUFFER
    if buffer is not None:
        buffer.buffer.clear()  # local attention's scratch space; it would count as "state"
    sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def environment() -> dict:
    import megatron.core

    try:
        import transformer_engine  # noqa: F401

        te = getattr(transformer_engine, "__version__", "installed")
    except Exception as error:  # noqa: BLE001
        te = f"not importable ({type(error).__name__}: {error})"
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "megatron_core": megatron.core.__version__, "transformer_engine": te,
        "python": sys.version.split()[0],
    }


def init_distributed() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not ARGS.smoke:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


# ------------------------------------------------------------------------------------------------
# Part 1: bytes per parameter of the grad buffer and optimizer state
# ------------------------------------------------------------------------------------------------


def gpt_config(bf16: bool, shape: dict) -> TransformerConfig:
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], bf16=bf16, params_dtype=dtype,
        pipeline_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0,
        transformer_impl="local",
    )


def optimizer_parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:  # skips Adam's scalar step counters
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def introspect(ddp, optimizer, model_ptrs: set[int]) -> dict:
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
    param_bytes = sum(b.param_data.numel() * b.param_data.element_size()
                      for b in ddp.buffers if b.param_data is not None)
    states, mains = [], []
    for part in optimizer_parts(optimizer):
        inner = part.optimizer
        for state in inner.state.values():
            states.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        for group in inner.param_groups:
            mains.extend(p for p in group["params"] if p.data_ptr() not in model_ptrs)
    state_dtypes = sorted({str(t.dtype) for t in states if t.dim() > 0})
    return {"grad_buffer_bytes": grad_bytes, "grad_buffer_dtype": str(ddp.buffers[0].grad_dtype),
            "param_buffer_bytes": param_bytes, "adam_state_bytes": tensor_bytes(states),
            "adam_state_dtypes": state_dtypes, "separate_main_param_bytes": tensor_bytes(mains)}


def measure_setting(label, bf16, grad_fp32, distopt, precision_aware, shape) -> dict:
    key = label.split(":")[0]
    row = {"setting": label, "key": key, "doc_formula_d1": DOC_FORMULA[key]}
    cleanup()
    dtype = torch.bfloat16 if bf16 else torch.float32
    extra = {}
    if precision_aware:
        extra = dict(use_precision_aware_optimizer=True, main_grads_dtype=torch.bfloat16,
                     exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    try:
        opt_config = OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=bf16,
                                     params_dtype=dtype, use_distributed_optimizer=distopt,
                                     clip_grad=1.0, **extra)
    except Exception as error:  # noqa: BLE001
        row["error"] = f"OptimizerConfig: {type(error).__name__}: {error}"
        return row
    m_start = mem()
    config = gpt_config(bf16, shape)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=shape["vocab_size"],
                     max_sequence_length=shape["seq_length"],
                     share_embeddings_and_output_weights=True)
    if not ARGS.smoke:
        # As stock get_model() does: a few modules (the learned position embedding) are built on
        # the CPU whatever use_cpu_initialization says.
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(config, model)
    n = sum(p.numel() for p in model.parameters())
    m_model = mem()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_fp32,
                                               use_distributed_optimizer=distopt,
                                               overlap_grad_reduce=False)
    ddp = DistributedDataParallel(config, ddp_config, model)
    m_ddp = mem()
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    m_opt = mem()
    model_ptrs = {p.data_ptr() for p in ddp.parameters()}

    b, s = shape["micro_batch"], shape["seq_length"]
    device = "cpu" if ARGS.smoke else "cuda"
    tokens = torch.randint(0, shape["vocab_size"], (b, s), device=device)
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    del loss
    parallel_state._GLOBAL_MEMORY_BUFFER.buffer.clear()  # attention scratch, not training state
    m_bwd = mem()
    torch.cuda.reset_peak_memory_stats()
    update_ok, grad_norm, _ = optimizer.step()
    m_step = mem()
    peak_step = torch.cuda.max_memory_allocated()
    info = introspect(ddp, optimizer, model_ptrs)
    row["optimizer_classes"] = [f"{type(part).__name__}({type(part.optimizer).__module__}."
                                f"{type(part.optimizer).__name__})"
                                for part in optimizer_parts(optimizer)]
    optimizer.zero_grad()
    ddp.zero_grad_buffer()
    cleanup()
    m_steady = mem()
    per = lambda delta: round(delta / n, 3)  # noqa: E731
    row.update({
        "params": n, "update_ok": bool(update_ok), "grad_norm": float(grad_norm or 0.0),
        "model_build_Bpp": per(m_model - m_start), "ddp_wrap_Bpp": per(m_ddp - m_model),
        "optimizer_init_Bpp": per(m_opt - m_ddp), "first_step_Bpp": per(m_step - m_bwd),
        "step_transient_peak_Bpp": per(peak_step - m_bwd),
        "total_after_step_Bpp": per(m_step - m_start),
        "total_after_zero_grad_Bpp": per(m_steady - m_start),
        "introspected": {k: (per(v) if k.endswith("_bytes") else v) for k, v in info.items()},
    })
    del optimizer, ddp, model
    cleanup()
    return row


def warm_up_cublas() -> None:
    """Allocate cuBLAS workspaces (forward thread and autograd thread) before any baseline."""
    device = "cpu" if ARGS.smoke else "cuda"
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(256, 256, device=device, dtype=dtype, requires_grad=True)
        (x @ x).float().sum().backward()
    del x
    cleanup()


def memory_section(shape) -> list[dict]:
    warm_up_cublas()
    rows = []
    for label, bf16, grad_fp32, distopt, pa in SETTINGS:
        try:
            row = measure_setting(label, bf16, grad_fp32, distopt, pa, shape)
        except Exception as error:  # noqa: BLE001
            row = {"setting": label, "key": label.split(":")[0],
                   "error": f"{type(error).__name__}: {error}",
                   "traceback": traceback.format_exc()[-3000:]}
            cleanup()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# Part 2: encoder throughput and peak memory
# ------------------------------------------------------------------------------------------------


def matmul_params(module) -> int:
    return sum(p.numel() for name, p in module.named_parameters()
               if p.dim() >= 2 and "position" not in name)


def bench_encoder(name, plugin_cls, flags, batches, lang_hidden) -> dict:
    cleanup()
    language = TransformerConfig(num_layers=1, hidden_size=lang_hidden, num_attention_heads=32
                                 if lang_hidden % 32 == 0 else 4, bf16=True,
                                 params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                                 hidden_dropout=0.0, attention_dropout=0.0,
                                 # TransformerConfig defaults to "transformer_engine"; encoders
                                 # copy it. No TE on the benchmark machine: the local spec.
                                 transformer_impl="local")
    parser = argparse.ArgumentParser()
    plugin_cls.add_arguments(parser)
    args = parser.parse_args(flags)
    grid = ModulePlacement(name=name, tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider=name)
    plugin = plugin_cls(name, args, grid)
    config = plugin.transformer_config(language)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    spec = plugin.submodule_spec(config, lang_hidden, pgc)
    result = {"encoder": name, "flags": " ".join(flags), "language_hidden": lang_hidden,
              "tokens_per_item": plugin.tokens_per_item, "num_layers": config.num_layers,
              "hidden": config.hidden_size}
    # build_module(spec) hands spec.submodules to the container's **kwargs, which ignores them
    # (an empty container); MimoModel builds modality containers with from_spec(). Record both.
    via_build_module = build_module(spec)
    result["build_module_encoders"] = list(via_build_module.encoders.keys())
    del via_build_module
    cleanup()
    m0 = mem()
    module = plugin.submodules_class.from_spec(spec)
    model_build.bind_tp_group(module, pgc.tp)
    wrapped = EncoderPrecisionWrapper(config, module)
    if not ARGS.smoke:
        wrapped = wrapped.cuda()
    result["params"] = sum(p.numel() for p in wrapped.parameters())
    result["param_dtypes"] = sorted({str(p.dtype) for p in wrapped.parameters()})
    result["param_MiB"] = round((mem() - m0) / MiB, 1)
    p_mm = matmul_params(wrapped)
    device = "cpu" if ARGS.smoke else "cuda"
    sample = plugin.preprocessor().example_inputs()
    runs = []
    for batch in batches:
        run = {"batch": batch}
        try:
            # fp32 inputs on purpose: the wrapper must cast them to bf16.
            inputs = {k: torch.randn((batch, *v.shape), device=device) for k, v in sample.items()}
            cleanup()
            base = mem()

            def step():
                wrapped.zero_grad(set_to_none=True)
                out = wrapped(encoder_inputs={name: inputs})
                out.float().square().mean().backward()
                return out

            out = step()
            run["output_shape"] = list(out.shape)
            run["output_dtype"] = str(out.dtype)
            assert out.dtype == torch.bfloat16, f"{name}: wrapper output is {out.dtype}, not bf16"
            assert out.shape == (batch * plugin.tokens_per_item, lang_hidden), out.shape
            del out
            for _ in range(ARGS.warmup - 1):
                step()
            sync()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(ARGS.iters):
                step()
            sync()
            seconds = (time.perf_counter() - start) / ARGS.iters
            tokens = batch * plugin.tokens_per_item
            s, h, layers = plugin.tokens_per_item, config.hidden_size, config.num_layers
            flops = 6 * p_mm * tokens + 12 * layers * s * h * tokens
            run.update({
                "step_ms": round(seconds * 1e3, 2), "samples_per_s": round(batch / seconds, 1),
                "tokens_per_s": round(tokens / seconds), "approx_TFLOPs": round(
                    flops / seconds / 1e12, 1),
                "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "peak_above_resident_GiB": round(
                    (torch.cuda.max_memory_allocated() - base) / 2**30, 2),
            })
            del inputs
        except torch.cuda.OutOfMemoryError as error:
            run["error"] = f"OutOfMemoryError: {str(error).splitlines()[0]}"
            inputs = None
        except Exception as error:  # noqa: BLE001
            run["error"] = f"{type(error).__name__}: {error}"
            run["traceback"] = traceback.format_exc()[-3000:]
            inputs = None
        wrapped.zero_grad(set_to_none=True)
        cleanup()
        print(json.dumps({"encoder": name, **run}), flush=True)
        runs.append(run)
    result["matmul_params"] = p_mm
    result["runs"] = runs
    del wrapped, module
    cleanup()
    return result


def encoder_section() -> list[dict]:
    lang = 128 if ARGS.smoke else LANGUAGE_HIDDEN
    specs = [("vit", ViTEncoder, VIT_SMOKE if ARGS.smoke else VIT_FLAGS,
              [2] if ARGS.smoke else [8, 16, 32]),
             ("audio", AudioFrameEncoder, AUDIO_SMOKE if ARGS.smoke else AUDIO_FLAGS,
              [2] if ARGS.smoke else [8, 32])]
    results = []
    for name, cls, flags, batches in specs:
        try:
            results.append(bench_encoder(name, cls, flags, batches, lang))
        except Exception as error:  # noqa: BLE001
            results.append({"encoder": name, "error": f"{type(error).__name__}: {error}",
                            "traceback": traceback.format_exc()[-3000:]})
            print(results[-1]["traceback"], flush=True)
            cleanup()
    return results


def main() -> None:
    init_distributed()
    out = {"environment": environment(), "command": " ".join(sys.argv)}
    print(json.dumps(out["environment"]), flush=True)
    if ARGS.section in ("all", "memory"):
        shape = GPT_SMOKE if ARGS.smoke else GPT
        out["gpt_shape"] = shape
        out["memory"] = memory_section(shape)
    if ARGS.section in ("all", "encoders"):
        out["encoders"] = encoder_section()
    print(json.dumps(out, indent=1), flush=True)
    if ARGS.json:
        with open(ARGS.json, "w") as handle:
            json.dump(out, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
