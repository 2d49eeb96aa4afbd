"""Stage 5, lower: rewrite the planned joint graph into the one per-rank graph every rank runs, with
local shapes and explicit collectives, split into forward and backward. The post-solve passes
(``passes/``) rewrite the planned graph (alias round-trips) and the lowered one (all-gather fusion,
FSDP recompute tags, contiguous collective inputs, all-reduce waits at their readers), and every
lowered graph is validated before it reaches a device, because a graph built on a CPU host can fail
on a GPU mesh in ways the host never sees."""
