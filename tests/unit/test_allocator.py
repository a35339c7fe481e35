"""The services' allocator settings (specrec_rpc.server.tune_allocator)."""

import sys

import pytest
from numpy._core.multiarray import _set_madvise_hugepage

from specrec_rpc.server import tune_allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_the_allocator_is_tuned_unless_the_environment_says_otherwise():
    was = _set_madvise_hugepage(True)
    try:
        done = tune_allocator({})
        assert done == {"NUMPY_MADVISE_HUGEPAGE": 0, "MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 1 << 20,
                        "MALLOC_TRIM_THRESHOLD_": 4 << 20}
        assert _set_madvise_hugepage(True) is False  # numpy no longer asks for huge pages
        # an operator's MALLOC_* (glibc applied it at start-up) and NUMPY_MADVISE_HUGEPAGE (numpy read it at
        # import) are left alone
        done = tune_allocator({"MALLOC_ARENA_MAX": "4", "MALLOC_TRIM_THRESHOLD_": "0", "NUMPY_MADVISE_HUGEPAGE": "1"})
        assert done == {"MALLOC_MMAP_THRESHOLD_": 1 << 20} and _set_madvise_hugepage(True) is True
    finally:
        _set_madvise_hugepage(was)


RELEASE_PROBE = """
import ctypes, os
from specrec_rpc.server import release_free_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
size = 64 << 10  # below glibc's mmap threshold: from the heap
blocks = [libc.malloc(size) for _ in range(1024)]  # 64 MiB
for b in blocks:
    ctypes.memset(b, 1, size)  # resident
for b in blocks[:-1]:  # freed; the last block holds the heap's top, so free() trims nothing
    libc.free(b)
before = rss()
print(release_free_memory(), before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_memory_freed_at_start_up_goes_back_to_the_system_before_serving():
    """settle_heap's release_free_memory: free heap pages glibc kept (a start-up's temporaries) are returned at
    once, not by a later free in the middle of a request (a 25-30 ms madvise on ten million items)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True)
    released, dropped = out.stdout.split()
    assert released == "True"
    assert int(dropped) >= 32 << 20, f"RSS fell by {int(dropped) >> 20} MiB of 64 freed"
