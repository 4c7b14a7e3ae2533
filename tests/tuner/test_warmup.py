"""rosekernels.warmup on top of the tuned store (CPU: compile and load, no launch)."""
import axpb_kernel
import jit_demo_kernel as demo
import pytest
from store_samples import META

import rosekernels
from rosekernels import jit, tuned
from rosekernels.startup import warmup
from sip.mutate import with_extra_stalls

VARIANT = axpb_kernel.Config("decode").variant()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Private compile and tuned-store roots; the demo kernel registered as a kernel module."""
    monkeypatch.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path / "rk"))
    monkeypatch.setenv(tuned.ENV_VAR, str(tmp_path / "sip"))
    monkeypatch.setitem(rosekernels.KERNELS, axpb_kernel.OP, "axpb_kernel")
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()
    yield
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()


def compile_demo() -> jit.CompiledKernel:
    return jit.compile_variant(VARIANT, demo.build)


def test_warmup_loads_the_tuned_cubin_and_reports_it(env):
    untuned = compile_demo()  # loaded untuned before warmup: warmup must reload it
    faster = with_extra_stalls(untuned.cubin)  # any same-size cubin stands in for a tuned one
    tuned.check_sm90_cubin(untuned.cubin)
    tuned.store(None, "axpb", VARIANT, untuned.cubin, faster, META)
    report = warmup([compile_demo])
    assert report.tuned == [VARIANT.key()] and report.untuned == []
    (k,) = report.kernels
    assert k.tuned and k.cubin == untuned.cubin and compile_demo() is k
    assert faster in jit.swap_cubins(k.object_bytes)[0]
    assert "1 tuned, 0 untuned" in str(report)


def test_warmup_never_loads_a_tuned_cubin_for_another_original(env):
    k = compile_demo()
    other = with_extra_stalls(k.cubin)  # pretend the kernel changed since tuning: the entry's original is `other`
    tuned.store(None, "axpb", VARIANT, other, k.cubin, META)
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="another original"):
        report = warmup([compile_demo])
    assert report.untuned == [VARIANT.key()] and report.stale == [VARIANT.key()] and not report.kernels[0].tuned


def test_warmup_of_a_corrupt_entry_warns_and_loads_untuned(env):
    k = compile_demo()
    path, _ = tuned.store(None, "axpb", VARIANT, k.cubin, with_extra_stalls(k.cubin), META)
    (path / "tuned.cubin").write_bytes(with_extra_stalls(k.cubin)[:500])
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="untuned"):
        report = warmup([compile_demo])
    assert report.untuned == [VARIANT.key()] and not report.kernels[0].tuned


@pytest.mark.parametrize("spec", [VARIANT, axpb_kernel.Config("decode")], ids=["variant", "config"])
def test_variants_and_configs_compile_through_their_kernel_module(env, spec):
    original = compile_demo().cubin
    tuned.store(None, "axpb", VARIANT, original, with_extra_stalls(original), META)
    jit.forget_loaded()
    report = warmup([spec])
    assert report.tuned == [VARIANT.key()] and report.kernels[0].variant == VARIANT


def test_bad_specs_are_named(env):
    with pytest.raises(TypeError, match="warmup spec"):
        warmup([42])
    with pytest.raises(ValueError, match="no kernel module for op 'nope'"):
        warmup([jit.Variant.of("nope", "decode")])


def test_warmup_of_a_package_kernel(env):
    """A kernel of the package, by its variant as the op would pick it (compiles qk_norm on the CPU)."""
    from rosekernels.kernels import qk_norm

    variant = qk_norm.config_for(qk_norm.Shape.defaults("decode")).variant()
    original = qk_norm.compile(qk_norm.Config.from_variant(variant)).cubin
    tuned.store(None, "qk_norm", variant, original, with_extra_stalls(original), META)
    jit.forget_loaded()
    report = warmup([variant])
    assert report.tuned == [variant.key()] and report.kernels[0].variant == variant
