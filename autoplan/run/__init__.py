"""Stage 6, run: the parallel module that executes the lowered graphs: the user's module with DTensor
parameters, the per-rank forward and backward behind one autograd function, and Inductor
compilation region by region, so identical layers compile once."""
