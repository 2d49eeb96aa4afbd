"""Progress of the long planning phases: a bar on a terminal, nothing otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """``items``, shown as a transient bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"autoplan: {desc}", total=total, leave=False, mininterval=0.5, file=sys.stderr)
