"""The public names of the package resolve to the ops, every kernel module follows the contract, and
CuTeDSL is pinned to sm_90a first."""
import importlib
import os

import pytest

import rosekernels
from rosekernels import contract


@pytest.mark.parametrize("name", rosekernels.__all__)
def test_every_export_is_a_callable(name):
    assert callable(getattr(rosekernels, name))


@pytest.mark.parametrize("kernel", sorted(rosekernels.KERNELS))
def test_every_kernel_module_follows_the_contract(kernel):
    assert contract.missing(importlib.import_module(rosekernels.KERNELS[kernel])) == []


@pytest.mark.parametrize("kernel", sorted(rosekernels.KERNELS))
def test_compile_keeps_no_cache_of_its_own(kernel, monkeypatch):
    """jit's in-memory cache is the only one: a module-level cache in front of it would survive
    jit.forget_loaded() (warm-up after a reset, tuned cubins loaded afresh) and hand back stale kernels."""
    from rosekernels import jit

    m = importlib.import_module(rosekernels.KERNELS[kernel])
    calls = []
    monkeypatch.setattr(jit, "compile_variant", lambda variant, build: calls.append(variant) or variant)
    config = m.variants_for()[0]
    assert m.compile(config) == m.compile(config) == config.variant()
    assert calls == [config.variant()] * 2


def test_arch_is_pinned_before_cutedsl_loads():
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute"):
        rosekernels.not_an_op  # noqa: B018
