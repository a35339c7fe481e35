"""The services' allocator settings (specrec_rpc.server.tune_allocator)."""

import sys

import pytest

from specrec_rpc.server import tune_allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_the_allocator_is_tuned_unless_the_environment_says_otherwise():
    done = tune_allocator({})
    assert done == {"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 1 << 20, "MALLOC_TRIM_THRESHOLD_": 4 << 20}
    # an operator's MALLOC_* (glibc applied it at start-up) is left alone
    done = tune_allocator({"MALLOC_ARENA_MAX": "4", "MALLOC_TRIM_THRESHOLD_": "0"})
    assert done == {"MALLOC_MMAP_THRESHOLD_": 1 << 20}
