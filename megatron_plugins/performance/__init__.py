"""What a run measures and reports about its own speed (issue 39), and the advisor's cost model.

The measured side: the phase recorder (:mod:`.recorder`) times each rank's step phases, from our
step code's marks (:mod:`megatron_plugins.step.phases`) and from probes over stock's calls
(:mod:`.probes`); a batch counter (:mod:`.batches`) counts each consumed microbatch's model FLOPs
(:mod:`megatron_plugins.flops`), tokens and items. From them: the throughput figures on stock's
log line, in TensorBoard and W&B (:mod:`.meter`, :mod:`.figures`, :mod:`.throughput`, against
:mod:`.peaks`), the step timeline (:mod:`.timeline`, :mod:`.picture`) and the profile file
(:mod:`.profile`). The launch installs all of it with one call, only when a flag asks for it
(:mod:`.measurement`; the flags: :mod:`.flags`). See docs/performance.md.
"""

__all__ = []
