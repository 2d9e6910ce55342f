"""What ``examples/mimo/pretrain_mimo.py`` and ``mimo-plan`` do before and around stock
``pretrain()``: the pre-import checks (:mod:`.preflight`), which flags the command line gives
(:mod:`.command_line`), settling the run's flags (:mod:`.settle`), the optimizer flags
(:mod:`.optimizer_flags`), the checkpoint guards (:mod:`.checkpoint_guards`), the launch itself
(:mod:`.pretrain`) and the planning view (:mod:`.plan`).

Nothing is imported here: the entry point imports torch and Megatron only after its checks.
"""

__all__ = []
