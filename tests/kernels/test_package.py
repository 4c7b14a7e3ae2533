"""The public names of the package resolve to the ops, every kernel module follows the contract, and
CuTeDSL is pinned to sm_90a first."""
import dataclasses
import inspect
import os
from pathlib import Path

import pytest

import rosekernels
from rosekernels import contract
from rosekernels.kernels import KERNELS, kernel_module


@pytest.mark.parametrize("name", rosekernels.__all__)
def test_every_export_is_a_callable(name):
    assert callable(getattr(rosekernels, name))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_kernel_module_follows_the_contract(kernel):
    m = kernel_module(kernel)
    assert contract.missing(m) == []
    assert m.OP == kernel  # its name everywhere: KERNELS, its variants, its tuned-store folder


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_variant_keys_round_trip(kernel):
    """Every listed config comes back from its variant with its launch policy at the defaults; a key
    leaves a KEY_DEFAULTS field out only at its dataclass default (from_variant restores that); a
    variant of another op is refused."""
    m = kernel_module(kernel)
    fields = {f.name: f for f in dataclasses.fields(m.Config)}
    assert m.Config.OP == m.OP and set(m.Config.POLICY_FIELDS) <= set(fields)
    for name, default in m.Config.KEY_DEFAULTS.items():
        assert callable(default) or fields[name].default == default, name
    for cfg in m.variants_for():
        back = m.Config.from_variant(cfg.variant())
        assert back.variant() == cfg.variant()
        assert back == dataclasses.replace(cfg, **{f: fields[f].default for f in m.Config.POLICY_FIELDS})
    other = dataclasses.replace(cfg.variant(), op="another_op")
    with pytest.raises(ValueError, match="another_op"):
        m.Config.from_variant(other)


def test_kernel_module_names_the_kernels():
    with pytest.raises(ValueError, match="no kernel module for 'nope'; the kernels are"):
        kernel_module("nope")
    assert rosekernels.KERNELS is KERNELS  # the package's face hands the registry on


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_compile_keeps_no_cache_of_its_own(kernel, monkeypatch):
    """jit's in-memory cache is the only one: a module-level cache in front of it would survive
    jit.forget_loaded() (warm-up after a reset, tuned cubins loaded afresh) and hand back stale kernels."""
    from rosekernels import jit

    m = kernel_module(kernel)
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


def _arity(fn) -> int:
    """How many arguments a loaded TVM-FFI function takes (it says so when called with none)."""
    with pytest.raises(TypeError, match=r"Expects \d+ parameters") as e:
        fn()
    return int(str(e.value).split("Expects ")[1].split()[0])


def test_the_compiled_function_takes_the_parameters_left_at_their_defaults():
    """CuTeDSL keeps a host __call__'s defaulted parameters (the FP8 scales and descales) in the compiled
    function's signature, also where compile left them out: a bf16 / fp16 launch passes them as None
    (NOT_FP8), and the count its call sites pass is the count of __call__'s parameters."""
    from rosekernels.kernels import append_kvcache, attention_decode, attention_decode_plan, gemm_leakyrelu, rmsnorm

    def call_params(kernel_class) -> int:
        return len(inspect.signature(kernel_class.__call__).parameters) - 2  # self, stream

    rms = next(c for c in rmsnorm.variants_for() if c.fp8 == "none")
    assert _arity(rmsnorm.compile(rms).fn) == call_params(rmsnorm.RMSNormKernel) == 6
    gemm = gemm_leakyrelu.variants_for()[0]  # bf16 or fp16: gemm_fp8 has the FP8 configs
    assert _arity(gemm_leakyrelu.compile(gemm).fn) == call_params(gemm_leakyrelu._GemmLeakyReluSm90) == 9 + len(
        gemm_leakyrelu.NOT_FP8)
    append = next(c for c in append_kvcache.variants_for() if not c.fp8)
    assert _arity(append_kvcache.compile(append).fn) == call_params(append_kvcache.AppendKernel) == 6 + len(
        append_kvcache.NOT_FP8)
    kv = next(c for c in attention_decode_plan.kvcache_variants_for() if not c.kv_fp8)
    assert _arity(attention_decode.compile(kv).fn) == call_params(attention_decode._KVCacheDecodeSm90) == 14 + len(
        attention_decode.NOT_FP8)


def test_no_kernel_module_exceeds_800_lines():
    """Host code (validation, planning, ops) lives in the plan and ops modules, not beside the device classes."""
    folder = Path(rosekernels.kernels.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 800} == {}
