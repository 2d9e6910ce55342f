"""Energon datasets (stock ``--data-path``): image-caption, VQA, audio-transcript and
conversation samples.

Every rank opens the same global stream: Energon with one data rank, the run's ``--seed`` and
``--num-workers``, batched into global microbatches of ``micro_batch_size x language dp``
samples, so sample order never depends on the layout. Energon's decoder is off; in the loader
workers each rank keeps only its positions of the microbatch (:class:`RankSlice`) and does only
its own work on them: language ranks tokenize text (read as UTF-8 where a ``field_map`` hands
its parts over as bytes) and never decode media, an encoder rank decodes and preprocesses only its
own modality. Errors are never skipped (Energon would skip a failing sample on one rank only,
which is silent misalignment): a sample that cannot be used stops training with its key.

- :mod:`.dataset`: a prepared dataset folder's metadata, and the checks that refuse one this run
  cannot read, before any process group;
- :mod:`.inputs`: what each rank makes of its positions of a sample (language: tokens laid out
  after the placeholder runs; an encoder: its decoded, preprocessed items);
- :mod:`.loader`: the source a run reads (:func:`~.loader.open_source`), Energon's loader per
  split, and its saved state.

The sample types and their fields are :mod:`megatron_plugins.data.samples`.
"""

__all__ = []
