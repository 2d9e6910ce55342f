"""Parameter-efficient fine-tuning: LoRA per part of the model and optimizer settings per part.

The flags and their checks before any import of torch (:mod:`.flags`), the adapters inside
Megatron's tensor-parallel linear layers (:mod:`.layers`), learning rate and weight decay per part
on the run's scheduler (:mod:`.optimizer`), checkpoints that leave the frozen base out and
reference it (:mod:`.checkpoint`), the launch's step that records and checks all of it
(:mod:`.settling`) and the adapters written out, merged or in the PEFT library's format
(:mod:`.export`)."""

__all__ = []
