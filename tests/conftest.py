"""Shared pytest setup: the `gpu` marker skips when no sm_90 CUDA device is visible, and the suite
never writes the user's caches."""
import os
import shutil
import tempfile

import pytest

from devices import HAS_SM90

from rosekernels import paths

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
_OWN_CACHE = None


def pytest_configure(config):
    """Unless the environment names them, the compile cache and the tuned store of the whole session
    (worker processes included: they inherit the environment) live in a temporary directory."""
    global _OWN_CACHE
    if "ROSEKERNELS_CACHE_DIR" not in os.environ:
        _OWN_CACHE = tempfile.mkdtemp(prefix="rosekernels-tests-")
        os.environ["ROSEKERNELS_CACHE_DIR"] = _OWN_CACHE
    os.environ.setdefault("SIP_CACHE_DIR", os.path.join(os.environ["ROSEKERNELS_CACHE_DIR"], "sip"))


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if HAS_SM90:
        return
    skip = pytest.mark.skip(reason="needs an sm_90 CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def environment_roots():
    """Each test starts from the environment's cache roots: warmup(cache_dir=, store_root=) and
    `rosekernels-cache build`, run in this process, choose them for the rest of the process."""
    yield
    paths.use_compile_cache_root(None)
    paths.use_tuned_store_root(None)


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """An empty compile cache for the module, so its CPU tests really compile."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path_factory.mktemp("rk-cache")))
    yield
    mp.undo()
