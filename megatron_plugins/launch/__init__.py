"""What ``examples/mimo/pretrain_mimo.py`` and ``mimo-plan`` do before and around stock
``pretrain()``: the pre-import checks, which parse the MiMo flags once (:mod:`.preflight`), the
command line as given (:mod:`.command_line`), settling the run's flags in declared steps
(:mod:`.settle`) with the checks that set nothing (:mod:`.flag_checks`) and the learning-rate
schedule's (:mod:`.scheduler_flags`), stock's own checks as one line (:mod:`.stock_checks`), the
optimizer flags (:mod:`.optimizer_flags`), the checkpoint guards (:mod:`.checkpoint_guards`), the
launch itself (:mod:`.pretrain`) and the planning view (:mod:`.plan`).

Nothing is imported here: the entry point imports torch and Megatron only after its checks.
"""

__all__ = []
