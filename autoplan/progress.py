"""Progress of the long planning phases: a bar on a terminal, nothing otherwise (logs, CI, pipes)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """``items``, shown as a transient bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"autoplan: {desc}", total=total, leave=False, mininterval=0.5, file=sys.stderr)


@contextlib.contextmanager
def ticker(desc: str, unit: str) -> Iterator[Callable[[], None]]:
    """A running count of steps whose total is unknown (module calls while tracing), shown like
    ``progress``; yields the function that counts one step."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(desc=f"autoplan: {desc}", unit=f" {unit}", leave=False, mininterval=0.5, file=sys.stderr) as bar:
        yield bar.update
