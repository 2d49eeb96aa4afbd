"""Post-solve graph passes: each takes a graph (and plan) and returns what it changed."""
