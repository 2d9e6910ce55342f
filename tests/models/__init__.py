"""Models tests build: the tiny transformer's flags, tiny Hugging Face models saved offline per
family (and the plugins, flags and references that go with them), hand-written Megatron
checkpoints."""
