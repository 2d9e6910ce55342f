"""The parallel layout of a run: the validated layout value (:mod:`.layout`), its checks against
the run's flags (:mod:`.checks`), the layout flags (:mod:`.flags`), the parser of the per-module
``NAME=VALUE`` flags (:mod:`.module_values`), the process groups of every module
(:mod:`.topology`), per-module RNG (:mod:`.rng`) and the colocated row-routing plan
(:mod:`.routing`).

``layout``, ``checks``, ``flags``, ``module_values`` and ``routing`` import neither torch nor
Megatron: the launch's pre-import checks and ``mimo-plan`` use them before anything heavy is
loaded.
"""

__all__ = []
