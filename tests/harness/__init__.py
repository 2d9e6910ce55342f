"""How tests run code: gloo worlds of forked or spawned ranks, torchrun and preforked launches of
the entry point, the MiMo / GPT / split-step training runs they share, and reading what a run
logged. Kept free of imports: the simulation's forkserver imports this package first."""
