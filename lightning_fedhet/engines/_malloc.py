"""Keep the CPU allocator from handing the cohort's large temporaries back to the kernel at every step.

A vmapped step of a convolutional network on a CPU allocates temporaries of tens of megabytes (activations, unfolded
inputs and gradients of ``C x B`` samples at once). glibc's ``malloc`` serves blocks above its mmap threshold (32 MiB
at most, adjusted as blocks are freed) with fresh ``mmap`` pages and gives freed memory at the top of the heap back to
the kernel above its trim threshold, so the same pages are faulted in and zeroed again at every local step. On a
2-core CPU the Fashion-MNIST CNN with 12 clients of 20 samples took 30,000 to 85,000 page faults and 40 to 130 ms of
system time a round that way (5 to 17 % of the round, varying with the heap's history: the "regression" of issue 25
had this cause, not a code change in the step), against none with the thresholds raised here. The sequential engine's
blocks are ``C`` times smaller and stay below the thresholds.

:func:`keep_freed_memory` raises both thresholds (``mallopt``) once per process, on glibc only. The cost: memory
freed by the process stays reserved to it (up to :data:`TRIM_THRESHOLD` bytes of free heap top) instead of returning
to the system, which is what PyTorch's CUDA caching allocator does on a GPU. Set ``LIGHTNING_FEDHET_MALLOPT=0`` to
leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: blocks up to this size come from the heap, not from fresh ``mmap`` pages
MMAP_THRESHOLD = 256 * 2**20
#: free memory at the heap's top is given back to the system only above this size
TRIM_THRESHOLD = 512 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; whether they are raised (False off glibc, or with
    ``LIGHTNING_FEDHET_MALLOPT=0``)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("LIGHTNING_FEDHET_MALLOPT", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # some glibc versions cap the mmap threshold at 32 MiB (half their largest heap): take that where 256 MiB is refused
    mmap = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) or bool(mallopt(_M_MMAP_THRESHOLD, 32 * 2**20))
    _applied = mmap and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
