"""sip-tune's command line: argument errors, the no-GPU exit, missing kernels, --list (no GPU needed)."""
import subprocess
import sys

import pytest

from conftest import HAS_SM90
from sip import cache, tuning
from test_sip_cache import FakeVariant, META, ORIGINAL, TUNED


def run(capsys, *argv):
    try:
        code = tuning.main(list(argv))
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "nope"], "invalid choice"),
    (["--kernel", "qk_norm", "--budget-iters", "10", "--budget-minutes", "1"], "not allowed with"),
    (["--mode", "decode"], "--kernel is required"),
    (["--kernel", "qk_norm", "--budget-iters", "0"], "--budget-iters must be >= 1"),
    (["--kernel", "qk_norm", "--budget-minutes", "-1"], "--budget-minutes must be > 0"),
    (["--kernel", "qk_norm", "--samples", "0"], "--samples"),
    (["--kernel", "qk_norm", "--runs", "0"], "--runs"),
    (["--kernel", "qk_norm", "--atol", "1e-3"], "--atol needs --rtol"),
    (["--kernel", "qk_norm", "--shape", "tokens"], "KEY=VALUE"),
    (["--kernel", "qk_norm", "--mode", "fast"], "invalid choice"),
])
def test_argument_errors_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_a_kernel_that_does_not_exist_yet_is_named(capsys, monkeypatch):
    monkeypatch.setitem(tuning.KERNELS, "attention", "rosekernels.kernels.no_such_module")
    code, _, err = run(capsys, "--kernel", "attention", "--budget-iters", "5")
    assert code == 2
    assert "'attention' is not available yet" in err and "does not exist yet" in err and "Tunable now:" in err
    ok, why = tuning.availability("attention")
    assert not ok and "no_such_module" in why


@pytest.mark.skipif(HAS_SM90, reason="checks the message shown without an sm_90 GPU")
def test_without_a_gpu_exit_2_with_a_clear_message(capsys, monkeypatch):
    monkeypatch.setattr(tuning, "availability", lambda kernel: (True, ""))
    code, _, err = run(capsys, "--kernel", "qk_norm", "--budget-iters", "5")
    assert code == 2 and "needs a CUDA sm_90 GPU" in err


@pytest.mark.skipif(HAS_SM90, reason="checks the message shown without an sm_90 GPU")
def test_the_installed_command_exits_2_without_a_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sip.tuning", "--kernel", "qk_norm", "--budget-minutes", "1",
                          "--cache", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "sm_90" in out.stderr and "Traceback" not in out.stderr


def test_list_shows_valid_and_broken_entries(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "current_toolchain", lambda: "test-toolchain")
    code, out, _ = run(capsys, "--list", "--cache", str(tmp_path))
    assert code == 0 and "0 entries" in out
    cache.store(tmp_path, "qk_norm", FakeVariant(d=128), ORIGINAL, TUNED, META)
    path, _ = cache.store(tmp_path, "rmsnorm", FakeVariant("rmsnorm", hidden=4096), ORIGINAL, TUNED, META)
    (path / "meta.json").write_text("{")
    code, out, _ = run(capsys, "--list", "--cache", str(tmp_path))
    assert code == 0 and "2 entries" in out
    assert f"{META['speedup']:.3f}x" in out and "NVIDIA H200" in out and FakeVariant(d=128).key() in out
    assert "rmsnorm" in out and "BROKEN" in out


def test_list_follows_the_environment_variable(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path / "c"))
    code, out, _ = run(capsys, "--list")
    assert code == 0 and str(tmp_path / "c") in out


def test_parse_shape_types_values():
    assert tuning.parse_shape("tokens=4, dtype=bf16,eps=1e-5,residual=true,x=False") == {
        "tokens": 4, "dtype": "bf16", "eps": 1e-5, "residual": True, "x": False}
    assert tuning.parse_shape("") == {}
    with pytest.raises(ValueError):
        tuning.parse_shape("tokens")


def test_tune_config_needs_exactly_one_budget():
    with pytest.raises(ValueError, match="exactly one budget"):
        tuning.TuneConfig()
    with pytest.raises(ValueError, match="exactly one budget"):
        tuning.TuneConfig(budget_iters=5, budget_seconds=5.0)
    split = tuning.TuneConfig(budget_iters=100, runs=4).anneal()
    assert split.max_iters == 25 and split.max_seconds is None


def test_every_cli_kernel_is_registered_and_the_existing_ones_are_tunable():
    import importlib.util

    assert set(tuning.KERNELS) == {"qk_norm", "rmsnorm", "moe_dispatch", "moe_combine", "gemm_leakyrelu",
                                   "attention", "attention_decode"}
    for kernel, module in tuning.KERNELS.items():
        exists = importlib.util.find_spec(module) is not None
        assert tuning.availability(kernel) == ((True, "") if exists else (False, f"module {module} does not exist yet"))
    assert tuning.availability("qk_norm") == (True, "")


@pytest.mark.parametrize("kernel", sorted(tuning.KERNELS))
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_workloads_pick_the_variant_of_their_mode(kernel, mode, monkeypatch):
    """The glue to each kernel module (compiling stubbed out: the kernels' own tests compile them)."""
    from types import SimpleNamespace

    if not tuning.availability(kernel)[0]:
        pytest.skip(f"{kernel} does not exist yet")
    module = tuning._module(kernel)
    for name in ("compile", "compiled"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda x, name=name: SimpleNamespace(
                variant=x if name == "compile" else x.variant()))
    single_mode = {"attention": "prefill", "attention_decode": "decode"}  # one kernel per op, one mode
    if single_mode.get(kernel, mode) != mode:
        with pytest.raises(ValueError, match=f"--mode {single_mode[kernel]}"):
            tuning.workload_factory(kernel, mode)()
        return
    workload = tuning.workload_factory(kernel, mode)()
    assert workload.kernel.variant.mode == mode and workload.name == kernel
    assert callable(workload.make_args) and callable(workload.test_args) and callable(workload.outputs)
    if kernel not in single_mode:  # a size of the other mode is refused with a hint
        other = {"qk_norm": "tokens", "rmsnorm": "rows", "moe_dispatch": "tokens", "moe_combine": "tokens",
                 "gemm_leakyrelu": "m"}[kernel]
        size = 4096 if mode == "decode" else 1
        with pytest.raises(ValueError, match="--mode"):
            tuning.workload_factory(kernel, mode, {other: size})()
