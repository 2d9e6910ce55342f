"""One training step of a MiMo run: the forward step and loss (:mod:`.forward`), per-module
gradient finalization under one global token count (:mod:`.grad_sync`), the three-phase step of
ranks hosting colocated encoders (:mod:`.colocated`) and the split train step (:mod:`.split`)."""

__all__ = []
