"""Data for a MiMo run: one global sample stream, sliced per rank, from the mock or Energon.

- :mod:`.addressing`: which positions of each global microbatch a rank holds, and the guard
  that checks encoder and language ranks consumed the same samples;
- :mod:`.streams`: batching, the per-rank stream stock ``pretrain()`` iterates, the provider;
- :mod:`.sources`: the data flags and which source a run reads;
- :mod:`.mock`: deterministic synthetic samples (the default, no ``--data-path``);
- :mod:`.energon`: Energon datasets (``--data-path``): the dataset folder's checks, each rank's
  inputs, the loader and its state; :mod:`.samples` is the sample schema it shares with
  ``tools.make_energon_dataset`` (sample types, their fields, the sample loaders); media decoding
  is :mod:`megatron_plugins.media`;
- :mod:`.text`: a sample's text, the placeholder tokens and the tokenizer flags, and
  :mod:`.tokenizer`: a real tokenizer laying out a sample (or rendering a conversation) as the
  language model's inputs.

Nothing is imported here, so the dataset tools can use :mod:`.samples` without loading Megatron.
"""

__all__ = []
