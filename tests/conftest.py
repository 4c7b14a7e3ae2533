"""Shared pytest setup: the `gpu` marker skips when no sm_90 CUDA device is visible."""
import os

import pytest

from devices import HAS_SM90

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_collection_modifyitems(config, items):
    if HAS_SM90:
        return
    skip = pytest.mark.skip(reason="needs an sm_90 CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """An empty compile cache for the module, so its CPU tests really compile."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path_factory.mktemp("rk-cache")))
    yield
    mp.undo()
