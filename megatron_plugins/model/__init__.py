"""Building this rank's MiMo model: the builder stock ``pretrain()`` calls through
``ModelConfig.builder`` (:mod:`.builder`), the language model from stock flags (:mod:`.language`),
DeepStack (:mod:`.deepstack`) and the per-module lifecycle: freezing, precision, DDP
(:mod:`.lifecycle`)."""

__all__ = []
