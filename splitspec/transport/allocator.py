"""Keep freed message buffers in the process heap (glibc's ``mallopt``).

A speculation step moves tap features of a few hundred KiB through every process: the target
copies them off the device, the gateway receives and forwards them, the draft receives them.
glibc trims the heap top as soon as more than twice its (adaptive) mmap threshold is free, so
such buffers page-fault their way in again and again: on the CI machine serialising a 245 KB
protobuf took 197 us instead of 12 us, and a 245 KB echo over a gRPC stream 1.19 ms instead of
0.58 ms. Fixing the mmap threshold at glibc's maximum (32 MiB: blocks below it come from the
heap) and the trim threshold well above it keeps those pages mapped. A fixed mmap threshold
below a message's size would be worse than glibc's adaptive one (with 16 MiB, decoding a 21 MB
prompt's features took 27 ms instead of 4.6 ms), hence the maximum. Messages over 32 MiB
still get fresh pages each time, as without this. The cost is up to ``TRIM_THRESHOLD`` bytes
of freed heap the process keeps instead of returning.

The thresholds can be overridden (or this left alone) with glibc's own ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` environment variables: when either is set, nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap: glibc's maximum on 64-bit hosts
TRIM_THRESHOLD = 128 << 20  # free heap top kept before it is returned to the OS
ENV_OVERRIDES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_message_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds; returns whether they were changed (False off glibc,
    or when the environment sets them)."""
    if any(name in os.environ for name in ENV_OVERRIDES):
        return False
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS neither)
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the message-buffer thresholds; allocations stay as they were")
    return ok
