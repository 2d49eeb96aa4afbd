"""``torch.compile`` backend for parallel modules: Inductor, keeping the plan's graph decisions."""

from __future__ import annotations

from collections.abc import Callable


def backend() -> Callable:
    from torch._inductor.compile_fx import compile_fx

    def autoplan_inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs)

    return autoplan_inductor
