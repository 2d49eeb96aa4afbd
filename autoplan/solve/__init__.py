"""Stage 4, solve: turn the priced strategies into a placement ILP (repeated layers sharing variables),
solve it under the user's constraints and memory caps, prove re-solves' starts with a Lagrangian
bound, and price the expanded plan from scratch into a ``Plan``, so the reported cost is the true
cost of what will run. Also here: the typed solver reports a plan carries, and the check that a
saved plan belongs to the model and mesh it is applied to."""
