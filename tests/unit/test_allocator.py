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
