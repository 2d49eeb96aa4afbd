"""Python's cyclic collector paused while autoplan builds large structures that live on."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for the block, and as it was after. Tracing and planning allocate
    millions of objects that outlive them (graph nodes, strategies, cost tables), and every full
    collection walks them all, a large share of a plan's time on a big model. Reference counting
    still frees whatever is not in a cycle; the collector deals with the rest once it runs again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.enable() if was else gc.disable()
