"""The compat package as a whole: importing it changes nothing, and its index of gaps names
real bridges and canaries."""

from __future__ import annotations

import subprocess
import sys

from tests.multiprocess import REPO_ROOT


SNAPSHOT = """
import importlib, pkgutil, sys, torch, torch.cuda, torch.distributed
import megatron.core.datasets.utils, megatron.core.parallel_state, megatron.training.initialize
import megatron.training.training, megatron.core.tensor_parallel.random
watched = [torch, torch.cuda, torch.cuda.random, torch.distributed,
           torch.distributed.distributed_c10d, torch.Tensor] + [
    module for name, module in sorted(sys.modules.items()) if name.startswith("megatron.")]
def snapshot():
    return {(getattr(w, "__name__", str(w)), name): id(value)
            for w in watched for name, value in list(vars(w).items())}
before = snapshot()
import megatron_plugins
names = sorted(m.name for m in pkgutil.walk_packages(megatron_plugins.__path__, "megatron_plugins."))
for name in names:
    importlib.import_module(name)
changed = sorted(key for key, value in snapshot().items() if before.get(key, value) != value)
print(len(names), changed)
"""


def test_importing_every_plugin_module_changes_nothing_in_torch_or_megatron():
    result = subprocess.run([sys.executable, "-c", SNAPSHOT], cwd=REPO_ROOT, text=True,
                            capture_output=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    count, changed = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 15  # every module of the package was imported
    assert changed == "[]"
