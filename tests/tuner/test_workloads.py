"""sip-tune's one workload builder over the kernel-module contract (sip_tune.workloads), on the CPU:
shapes, configs and the mode check for every kernel of the package (no compile), and a whole
workload of the demo kernel module (compiled, not run)."""
import pickle

import axpb_kernel
import pytest

import rosekernels
from rosekernels.kernels import kernel_module
from sip_tune import workloads

# The kernels with one mode only; every other kernel has both.
SINGLE_MODE = {"attention": "prefill", "attention_decode": "decode"}
# The size of each two-mode kernel that decides the mode, and a size of prefill mode (1 is decode).
SIZE = {"qk_norm": "tokens", "rmsnorm": "rows", "moe_dispatch": "tokens", "moe_combine": "tokens",
        "gemm_leakyrelu": "m", "grouped_gemm": "rows", "quantize_fp8": "rows", "gemm_fp8": "m"}
PREFILL_SIZE = {"grouped_gemm": 1 << 16}  # 512 rows per expert of the default 128


@pytest.fixture
def axpb(tmp_path, monkeypatch):
    monkeypatch.setenv("ROSEKERNELS_CACHE_DIR", str(tmp_path / "rk"))
    monkeypatch.setitem(rosekernels.KERNELS, "axpb", "axpb_kernel")


def test_a_workload_is_the_kernel_modules_own_for_the_shape_and_mode(axpb):
    factory = workloads.factory("axpb", "decode", {"n": 77})
    assert pickle.loads(pickle.dumps(factory)).args == ("axpb", "decode", {"n": 77})  # goes to the worker
    w = factory()
    assert w.name == "axpb" and w.kernel.variant == axpb_kernel.Config("decode").variant()
    assert callable(w.make_args) and callable(w.test_args) and callable(w.check)
    assert workloads.resolve("axpb", "prefill") == (axpb_kernel.Config("prefill"), axpb_kernel.Shape(1 << 20))


def test_shape_errors_name_the_keys_and_the_mode_to_pass(axpb):
    with pytest.raises(ValueError, match=r"unknown shape keys \['tokens'\].*\['dtype', 'n'\]"):
        workloads.resolve("axpb", "decode", {"tokens": 4})
    with pytest.raises(ValueError, match="selects the prefill variant, not decode; pass --mode prefill"):
        workloads.resolve("axpb", "decode", {"n": 10**6})
    with pytest.raises(ValueError, match="no kernel module for 'nope'"):
        workloads.resolve("nope", "decode")


@pytest.mark.parametrize("kernel", sorted(rosekernels.KERNELS))
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_every_kernel_resolves_its_default_shape_to_a_config_of_the_mode(kernel, mode):
    if SINGLE_MODE.get(kernel, mode) != mode:
        with pytest.raises(ValueError, match=f"--mode {SINGLE_MODE[kernel]}"):
            workloads.resolve(kernel, mode)
        return
    config, shape = workloads.resolve(kernel, mode)
    assert config.variant().mode == mode and config.variant().op == kernel
    assert shape == kernel_module(kernel).Shape.defaults(mode)
    if kernel in SIZE:  # a size of the other mode is refused with a hint
        with pytest.raises(ValueError, match="--mode"):
            workloads.resolve(kernel, mode, {SIZE[kernel]: PREFILL_SIZE.get(kernel, 4096) if mode == "decode" else 1})
