"""Host allocator settings for timing steps on a CPU."""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_host_memory() -> bool:
    """Have glibc keep freed blocks for reuse instead of handing them back to the kernel.

    A per-rank program gathers its parameters into fresh buffers every step and frees them after
    use. Left to glibc's defaults, each large buffer is its own ``mmap``, so every step pays the
    kernel's page faults and zeroing for megabytes of memory, and step times swing by 20% with
    where the pages land. On a GPU the caching allocator keeps such blocks; this gives the CPU
    the same behaviour, for the planned and the plain program alike. Returns whether it applied
    (``False`` off glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, 32 * 2**20), (_M_TRIM_THRESHOLD, 2**30), (_M_TOP_PAD, 256 * 2**20))
    return all(mallopt(param, value) == 1 for param, value in settings)
