"""The platform signature: what a run's float results depend on (CPU, the instruction set torch
dispatches to, math libraries, versions, threads, dispatch switches), recorded beside the goldens
so a comparison knows whether it runs on the recording host or another one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from typing import Any

NUMERICS_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_NUM_THREADS",
                "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS")
"""Environment switches that change which kernels (and so which float rounding) a run gets."""
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")

_SIGNATURE_PROBE = """
import json, os, re, torch
from importlib.metadata import version
info = {}
for line in open("/proc/cpuinfo"):
    key, _, value = line.partition(":")
    info.setdefault(key.strip(), value.strip())
config = torch.__config__.show()
def find(pattern):
    match = re.search(pattern, config)
    return match.group(1).strip() if match else None
flags = set(info.get("flags", "").split())
print(json.dumps({
    "cpu_vendor": info.get("vendor_id"),
    "cpu_model": info.get("model name"),
    "cpu_isa_flags": [f for f in ISA_FLAGS if f in flags],
    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "torch": torch.__version__,
    "megatron_core": version("megatron-core"),
    "mkl": find(r"Math Kernel Library Version ([^\\n]+)"),
    "onednn": find(r"MKL-DNN (v[^ \\n]+)"),
    "torch_threads": torch.get_num_threads(),
    "numerics_env": {name: os.environ.get(name) for name in NUMERICS_ENV},
}, sort_keys=True))
"""


def platform_signature(env: dict[str, str]) -> dict[str, Any]:
    """What a run's float results depend on, probed in a process with the ranks' environment."""
    numerics = tuple((name, env.get(name)) for name in NUMERICS_ENV)
    return json.loads(_probe_signature(numerics, env.get("PYTHONPATH")))


@lru_cache(maxsize=None)
def _probe_signature(numerics: tuple[tuple[str, str | None], ...], pythonpath: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in NUMERICS_ENV}
    env.update({k: v for k, v in numerics if v is not None})
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    prelude = f"ISA_FLAGS = {ISA_FLAGS!r}\nNUMERICS_ENV = {NUMERICS_ENV!r}\n"
    result = subprocess.run([sys.executable, "-c", prelude + _SIGNATURE_PROBE], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    return result.stdout.strip().splitlines()[-1]


def signature_differences(recorded: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """Keys where the goldens' signature and this run's differ (all of them if none recorded)."""
    if recorded is None:
        return ["no recorded signature"]
    return sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
