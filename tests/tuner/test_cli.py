"""sip-tune's command line: argument errors, the no-GPU exit, --list (no GPU, no torch needed)."""
import subprocess
import sys

import pytest
from devices import HAS_SM90
from store_samples import META, ORIGINAL, TUNED, FakeVariant, checks, qk_norm_kernel

import rosekernels
from rosekernels import paths, tuned
from rosekernels.device import NO_GPU_EXIT
from sip_tune import cli


def run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "nope"], "invalid choice"),
    (["--kernel", "qk_norm", "--budget-iters", "10", "--budget-minutes", "1"], "not allowed with"),
    (["--mode", "decode"], "--kernel is required"),
    (["--kernel", "qk_norm", "--budget-iters", "0"], "--budget-iters must be >= 1"),
    (["--kernel", "qk_norm", "--budget-iters", "-1", "--moves", "control", "--start", "floor"], "must be >= 1 (0,"),
    (["--kernel", "qk_norm", "--budget-minutes", "-1"], "--budget-minutes must be > 0"),
    (["--kernel", "qk_norm", "--samples", "-1"], "--samples"),
    (["--kernel", "qk_norm", "--runs", "0"], "--runs"),
    (["--kernel", "qk_norm", "--atol", "1e-3"], "--atol needs --rtol"),
    (["--kernel", "qk_norm", "--shape", "tokens"], "KEY=VALUE"),
    (["--kernel", "qk_norm", "--mode", "fast"], "invalid choice"),
    # refused before the GPU check (which exits 3 here) and before --plan answers
    (["--kernel", "qk_norm", "--moves", "alu", "--start", "floor"], "(add control)"),
    (["--kernel", "qk_norm", "--moves", "alu", "--start", "floor", "--plan"], "(add control)"),
    (["--kernel", "qk_norm", "--start", "last"], "invalid choice"),
    (["--model", "examples/configs/qwen3_8b.json", "--start", "floor"], "--model tunes configs"),
])
def test_argument_errors_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_every_kernel_of_the_package_can_be_asked_for(capsys):
    assert set(rosekernels.KERNELS) == {"qk_norm", "rmsnorm", "moe_dispatch", "moe_combine", "gemm_leakyrelu",
                                        "attention", "attention_decode", "append_kvcache", "grouped_gemm",
                                        "quantize_fp8", "gemm_fp8", "moe_route"}
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out, _ = capsys.readouterr()
    assert all(k in out for k in rosekernels.KERNELS)


@pytest.mark.skipif(HAS_SM90, reason="checks the message shown without an sm_90 GPU")
def test_without_a_gpu_exit_3_with_a_clear_message(capsys):
    code, _, err = run(capsys, "--kernel", "qk_norm", "--budget-iters", "5")
    assert code == NO_GPU_EXIT == 3 and "needs a CUDA sm_90 GPU" in err
    # the floor alone (no search) passes the argument checks, then needs the GPU as well
    code, _, err = run(capsys, "--kernel", "qk_norm", "--budget-iters", "0", "--moves", "control", "--start", "floor")
    assert code == NO_GPU_EXIT and "needs a CUDA sm_90 GPU" in err


class ReachedLevelOne(Exception):
    pass


@pytest.fixture
def gpu_without_tools(monkeypatch):
    """A GPU host as the command sees it, with neither compute-sanitizer nor ncu; level 1 raises when reached."""
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli.probe, "sanitizer_problem", lambda: "compute-sanitizer not found on PATH")
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)

    def level_one(*args, **kwargs):
        raise ReachedLevelOne

    monkeypatch.setattr(cli.configs, "tune_configs", level_one)


@pytest.mark.parametrize("argv, message", [([], "compute-sanitizer not found"),
                                           (["--levels", "config"], "compute-sanitizer not found"),
                                           (["--no-sanitize", "--hot", "ncu"], "ncu not found")])
def test_a_missing_tool_is_reported_before_any_gpu_work(capsys, gpu_without_tools, argv, message):
    """Compute-sanitizer runs a winner of either level before it is stored; ncu is for --hot ncu."""
    code, _, err = run(capsys, "--kernel", "qk_norm", "--budget-iters", "5", *argv)
    assert code == 2 and message in err


def test_level_one_without_the_sanitizer_needs_neither_tool(capsys, gpu_without_tools):
    with pytest.raises(ReachedLevelOne):
        cli.main(["--kernel", "qk_norm", "--budget-iters", "5", "--levels", "config", "--no-sanitize", "--hot", "ncu"])


@pytest.mark.skipif(HAS_SM90, reason="checks the message shown without an sm_90 GPU")
def test_the_command_exits_3_without_a_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sip_tune.cli", "--kernel", "qk_norm", "--budget-minutes", "1",
                          "--cache", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == NO_GPU_EXIT, out.stderr
    assert "sm_90" in out.stderr and "Traceback" not in out.stderr


def test_list_shows_valid_and_broken_entries(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tuned, "current_toolchain", lambda: "test-toolchain")
    code, out, _ = run(capsys, "--list", "--store-root", str(tmp_path))
    assert code == 0 and "0 tuned configs, 0 tuned cubins" in out
    tuned.store(tmp_path, "qk_norm", FakeVariant(d=128), ORIGINAL, TUNED, META)
    path, _ = tuned.store(tmp_path, "rmsnorm", FakeVariant("rmsnorm", hidden=4096), ORIGINAL, TUNED, META)
    (path / "meta.json").write_text("{")
    code, out, _ = run(capsys, "--list", "--store-root", str(tmp_path))
    assert code == 0 and "2 tuned cubins" in out and "below the default bar" not in out
    assert f"{META['speedup']:.3f}x" in out and "NVIDIA H200" in out and FakeVariant(d=128).key() in out
    assert "rmsnorm" in out and "BROKEN" in out
    # entries below the bar, each with its reason: a cubin checked on 50 samples, a config from before checks
    tuned.store(tmp_path, "qk_norm", FakeVariant(d=64), ORIGINAL, TUNED, {**META, "checks": checks(samples=50)})
    from rosekernels.kernels import qk_norm_plan as plan

    shape = plan.QKNormShape(3000)
    heuristic = plan.config_for(shape, 132)
    other = next(c for c in plan.candidates(shape, 132) if c.variant() != heuristic.variant())
    tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, "ab" * 32, {"speedup": 1.3})
    tuned.forget_configs()
    code, out, _ = run(capsys, "--list", "--cache", str(tmp_path))  # --store-root's former name
    lines = out.splitlines()
    assert code == 0 and "1 tuned configs, 3 tuned cubins, 2 below the default bar (not loaded unless SIP_ALLOW_UNVERIFIED=1)" in lines[0]
    config_line = next(i for i, line in enumerate(lines) if " config " in line)
    assert f"{heuristic.variant().key()} -> {other.variant().key()}" in lines[config_line]
    assert lines[config_line + 1].strip().startswith("below the bar: unverified: written before entries recorded")
    cubin_line = next(i for i, line in enumerate(lines) if FakeVariant(d=64).key() in line)
    assert "50 samples" in lines[cubin_line] and "50 of 50 samples passed" in lines[cubin_line + 1]


@pytest.mark.parametrize("speedup", [None, 10**400], ids=["null", "10**400"])
def test_list_shows_an_entry_with_malformed_fields_below_the_bar(capsys, tmp_path, monkeypatch, speedup):
    """Hand-edited: null, text or a number past the float range where numbers belong; listed with the
    reason, not a traceback."""
    import json

    from rosekernels.kernels import qk_norm_plan as plan

    monkeypatch.setattr(tuned, "current_toolchain", lambda: "test-toolchain")
    shape = plan.QKNormShape(3000)
    heuristic = plan.config_for(shape, 132)
    other = next(c for c in plan.candidates(shape, 132) if c.variant() != heuristic.variant())
    path, _ = tuned.store_config(tmp_path, qk_norm_kernel(), shape, other, heuristic, "ab" * 32, {})
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "speedup": speedup, "mode": None,
                                "checks": {**checks("config"), "samples": "all of them"}}))
    code, out, _ = run(capsys, "--list", "--store-root", str(tmp_path))
    assert code == 0 and "1 below the default bar" in out
    assert "nanx" in out and "below the bar: malformed samples record all of them" in out


def test_list_shows_the_entries_shipped_with_the_package_after_the_store(capsys, tmp_path, monkeypatch):
    code, out, _ = run(capsys, "--list", "--store-root", str(tmp_path))
    shipped = sorted(tuned.SHIPPED_ROOT.glob("*/*/*/*/meta.json"))
    lines = out.splitlines()
    assert code == 0 and "0 tuned cubins" in lines[0]
    assert f"shipped with rosekernels ({tuned.SHIPPED_ROOT}): {len(shipped)} tuned cubins" in lines[1]
    assert sorted(line.split()[-1] for line in lines[2:]) == sorted(p.parent.parent.name for p in shipped)
    assert "below the bar" not in out and "BROKEN" not in out
    code, out, _ = run(capsys, "--list", "--store-root", str(tuned.SHIPPED_ROOT))  # the shipped root itself: once
    assert code == 0 and "shipped with" not in out and f"{len(shipped)} tuned cubins" in out
    monkeypatch.setattr(tuned, "SHIPPED_ROOT", tmp_path / "none")
    code, out, _ = run(capsys, "--list", "--store-root", str(tmp_path))
    assert code == 0 and "shipped with" not in out


def test_list_of_a_folder_that_does_not_exist_or_of_a_file_says_so(capsys, tmp_path):
    code, _, err = run(capsys, "--list", "--store-root", str(tmp_path / "typo"))
    assert code == 2 and f"--store-root {tmp_path / 'typo'} does not exist" in err
    (tmp_path / "store.json").write_text("{}")
    code, _, err = run(capsys, "--list", "--cache", str(tmp_path / "store.json"))
    assert code == 2 and "is a file, not a folder" in err and "does not exist" not in err


def test_list_follows_the_environment_variable(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "c"))
    code, out, _ = run(capsys, "--list")
    assert code == 0 and str(tmp_path / "c") in out


def test_list_imports_neither_torch_nor_cutedsl(tmp_path):
    script = ("import sys\nfrom sip_tune import cli\nassert cli.main(['--list', '--cache', sys.argv[1]]) == 0\n"
              "print(sorted(m for m in ('torch', 'cutlass', 'tvm_ffi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"


def test_parse_shape_types_values():
    assert cli.parse_shape("tokens=4, dtype=bf16,eps=1e-5,residual=true,x=False") == {
        "tokens": 4, "dtype": "bf16", "eps": 1e-5, "residual": True, "x": False}
    assert cli.parse_shape("") == {}
    with pytest.raises(ValueError):
        cli.parse_shape("tokens")
