"""What the forkserver behind ``run_in_processes(..., simulated=True)`` imports once, so that
every simulated test rank is forked ready instead of importing torch and Megatron again (seconds
of CPU per rank on a 2-core machine, hundreds of ranks per suite).

It does what each such rank otherwise does first, in the same order: switch the process to the CPU
simulation (which patches torch and then imports ``megatron.training``), then import
``megatron.core``, then the text tokenizers stock's ``set_global_variables`` imports to build any
tokenizer, ``NullTokenizer`` included (transformers with them: ~2 s of CPU per rank). Then the
code every MiMo rank runs: the entry point's launch, the model builder, the colocated step and the
built-in encoders (importing them changes nothing in torch or Megatron: their bridges act only when
a launch installs them, so a rank that checks stock behaviour still runs stock code), and stock's
flag help texts, read once (:mod:`tests.harness.stock_arguments`).
"""

from megatron_plugins.cpu_simulation import patches

patches.activate()

import megatron.core  # noqa: E402,F401  (after the simulation's patches, as in every rank)
import megatron.training  # noqa: E402,F401
import megatron.core.tokenizers.text  # noqa: E402,F401  (what stock's tokenizer build imports)

import megatron_plugins.encoders.audio  # noqa: E402,F401
import megatron_plugins.encoders.vit  # noqa: E402,F401
import megatron_plugins.launch.pretrain  # noqa: E402,F401
import megatron_plugins.model.builder  # noqa: E402,F401
import megatron_plugins.step.colocated  # noqa: E402,F401
from tests.harness.stock_arguments import remember_field_docstrings  # noqa: E402

remember_field_docstrings(warm=True)

import gc  # noqa: E402

# Everything loaded so far lives as long as the server: out of the collector's sight, a forked
# rank's collections (and its loader workers', which Energon starts with a walk over every tracked
# object, then a full collection) skip it and leave its pages shared (the gc.freeze recipe).
gc.freeze()
