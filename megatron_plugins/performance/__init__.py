"""What a run measures and reports about its own speed (issue 39), and the layout advisor's
cost model.

The measured side: the phase recorder (:mod:`.recorder`) times each rank's step phases, from our
step code's marks (:mod:`megatron_plugins.step.phases`) and from probes over stock's calls
(:mod:`.probes`); a batch counter (:mod:`.batches`) counts each consumed microbatch's model FLOPs
(:mod:`megatron_plugins.flops`), tokens and items. From them: the throughput figures on stock's
log line, in TensorBoard and W&B (:mod:`.meter`, :mod:`.figures`, :mod:`.throughput`, against
:mod:`.peaks`), the step timeline (:mod:`.timeline`, :mod:`.picture`) and the profile file
(:mod:`.profile`). The launch installs all of it with one call, only when a flag asks for it
(:mod:`.measurement`; the flags: :mod:`.flags`). See docs/performance.md.

The advisor (``mimo-plan --advise``): the known GPUs (:mod:`.gpus`), a run's work per module
(:mod:`.workload`) and its data (:mod:`.data`), the layouts it can run (:mod:`.candidates`), their
memory per rank (:mod:`.memory`) and step time (:mod:`.cost_model`, with the assumptions of
:mod:`.assumptions`), calibration from a measured run's profile (:mod:`.calibration`) and the
report (:mod:`.advisor`). The advisor imports neither torch nor Megatron; the launch parses the
flags and builds the plugins. Below ``launch``, above ``model``.
"""

__all__ = []
