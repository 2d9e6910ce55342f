"""What a run measures and reports about its own speed, and the layout advisor's cost model.

The advisor (``mimo-plan --advise``): the known GPUs (:mod:`.gpus`), a run's work per module
(:mod:`.workload`) and its data (:mod:`.data`), the layouts it can run (:mod:`.candidates`), their
memory per rank (:mod:`.memory`) and step time (:mod:`.cost_model`, with the assumptions of
:mod:`.assumptions`), calibration from a measured run's profile (:mod:`.calibration`) and the
report (:mod:`.advisor`). Nothing here imports torch or Megatron; the launch parses the flags and
builds the plugins. Below ``launch``, above ``model``.
"""

__all__ = []
