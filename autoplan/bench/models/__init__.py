"""Models the benchmarks, examples and tests plan: written in plain PyTorch, as users write theirs."""
