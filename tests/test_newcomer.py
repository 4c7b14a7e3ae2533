"""A new user's first hour (issue 45), scripted on a CPU: the install the README gives, the main job, every
command that must refuse bad input before any work (each stopped before it would compile or time anything:
the compile and GPU entry points are replaced by ones that fail the test if reached), the cubin of a
compile-cache entry, one no-GPU exit code, the package's namespace, and a README whose every figure links a
committed JSON. Seconds, not minutes: nothing here compiles a kernel."""
import dataclasses
import hashlib
import importlib.util
import json
import random
import re
import struct
import sys
from pathlib import Path

import pytest
from sip_corpus import CORPUS_SOURCES, compile_cu

import rosekernels
from rosekernels import cache_cli, device, jit, models, startup, tuned
from rosekernels.device import NO_GPU_EXIT
from rosekernels.kernels import kernel_module
from sip import cli as sip_cli
from sip_tune import cli, configs, model, workloads

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
QWEN3_8B = ROOT / "examples" / "configs" / "qwen3_8b.json"
LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
        "torch_dtype": "float32"}


def run(capsys, main, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_work(monkeypatch):
    """Compiling, GPU tuning or a GPU check past this point is work: reaching any fails the test."""
    def reached(*args, **kwargs):
        raise AssertionError("work started before the bad input was refused")

    monkeypatch.setattr(jit, "compile_cold", reached)
    monkeypatch.setattr(configs, "tune_configs", reached)
    monkeypatch.setattr(model, "tune", reached)
    monkeypatch.setattr(cli, "gpu_problem", reached)


def config_file(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


# ---------------------------------------------------------------------------------------------
# Install


def test_the_dependencies_follow_the_readmes_install():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {r.name: r for r in map(Requirement, project["dependencies"])}
    extras = {name: {r.name: r for r in map(Requirement, reqs)}
              for name, reqs in project["optional-dependencies"].items()}
    # torch is installed first (the README's step 1) and never pulled to another version: a lower bound only,
    # the oldest release the results used.
    assert not base["torch"].specifier.contains("2.10") and base["torch"].specifier.contains("2.11.0")
    assert base["torch"].specifier.contains("2.14.0")
    # cuda-python follows the driver's CUDA major, so it is in the driver extras only, bounded to that major.
    assert "cuda-python" not in base
    cu12, cu13 = extras["cu12"]["cuda-python"].specifier, extras["cu13"]["cuda-python"].specifier
    assert cu12.contains("12.9") and not cu12.contains("13.0") and cu13.contains("13.4") and not cu13.contains("14.0")
    assert "cu13" in extras["cu13"]["nvidia-cutlass-dsl"].extras
    nvdisasm = base["nvidia-cuda-nvdisasm"].specifier
    assert nvdisasm.contains("13.5") and not nvdisasm.contains("14.0") and not nvdisasm.contains("12.8")
    # Every extra the README names exists, and the install table's torch builds match their extras.
    named = set(re.findall(r"pip install -e '\.\[([\w,]+)\]'", README))
    assert named and all(set(n.split(",")) <= set(extras) for n in named)
    for cuda, extra in (("cu130", "cu13"), ("cu128", "cu12"), ("cpu", "cu13,dev")):
        assert re.search(rf"whl/{cuda}` \| `pip install -e '\.\[{extra}\]'`", README), cuda
    assert "pip install 'rosekernels[" not in README  # a clone installs with -e '.[...]'


# ---------------------------------------------------------------------------------------------
# The main job


def _jobs_and_clock(monkeypatch, durations):
    """Level 1 replaced by a stand-in that takes durations[i] seconds of a fake clock for search i."""
    now = [0.0]
    searched = []

    def tune_configs(kernel, mode, overrides, **kw):
        now[0] += durations[len(searched)]
        searched.append((kernel, dict(overrides)))
        return configs.ConfigReport(kernel, mode, overrides, {}, heuristic_us=10.0, tuned_us=10.0, aa_spread=0.001,
                                    outcome="the heuristic stays", settled=True)

    monkeypatch.setattr(configs, "tune_configs", tune_configs)
    monkeypatch.setattr(model, "stored_entry", lambda job, mode, root=None: None)  # an empty store
    return now, searched


@pytest.mark.parametrize("seed", range(3))
def test_the_budget_holds_across_a_models_shapes(monkeypatch, seed):
    rng = random.Random(seed)
    found = model.shapes(models.ModelDims.from_config(QWEN3_8B), "decode")
    first = rng.uniform(20, 40)
    durations = [first] + [rng.uniform(10, first) for _ in found.jobs]  # none longer than the first
    now, searched = _jobs_and_clock(monkeypatch, durations)
    budget = rng.uniform(60, 300)  # less than the 40 shapes take
    rows = model.tune(found, budget_s=budget, clock=lambda: now[0])
    ran = len(searched)
    assert 0 < ran < len(found.jobs)
    assert now[0] <= budget + max(0.0, first - model.SHAPE_ESTIMATE_S)  # only the first search is a guess
    assert budget - now[0] < max(durations[:ran])  # the next shape would not have fit
    assert [r.status for r in rows[ran:]] == [model.NOT_REACHED] * (len(found.jobs) - ran)
    assert [r.job for r in rows] == found.jobs  # every shape reported, in order: small token counts first
    assert [s["m"] if k == "gemm_leakyrelu" else s["batch"] for k, s in searched] == sorted(
        s["m"] if k == "gemm_leakyrelu" else s["batch"] for k, s in searched)


def _entry(job, speedup, heuristic_us):
    config, _ = workloads.resolve(job.kernel, "decode", job.shape)
    chosen = config if speedup == 1.0 else dataclasses.replace(config, raster_group=config.raster_group + 1)  # another
    return tuned.ConfigEntry(Path("entry.json"), {"heuristic_median_us": heuristic_us, "speedup": speedup},
                             chosen, config)


def test_the_main_job_ends_with_what_the_store_gained(monkeypatch, capsys, tmp_path):
    found = model.shapes(models.ModelDims.from_config(QWEN3_8B), "decode")
    gemms = [j for j in found.jobs if j.kernel == "gemm_leakyrelu" and j.tokens in (1, 2)]
    stored = {gemms[0]: _entry(gemms[0], 1.04, 50.0), gemms[1]: _entry(gemms[1], 1.0, 12.0),
              gemms[4]: _entry(gemms[4], 1.02, 30.0)}
    monkeypatch.setattr(model, "stored_entry", lambda job, mode, root=None: stored.get(job))
    seen = {}

    def tune(shapes, **kw):
        seen.update(kw)
        return [model.Row(job, "tuned" if job in stored else model.NOT_REACHED) for job in shapes.jobs]

    monkeypatch.setattr(model, "tune", tune)
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli.probe, "sanitizer_problem", lambda: None)  # a GPU host has compute-sanitizer
    out_json = tmp_path / "run.json"
    code, out, err = run(capsys, cli.main, "--model", QWEN3_8B, "--mode", "decode", "--budget-minutes", "2.5",
                         "--json", out_json)
    assert code == 0, err
    assert seen["budget_s"] == 150 and seen["sanitize"]  # its winners run under compute-sanitizer
    gains = model.gains([model.Row(j, "tuned") for j in stored], "decode")
    assert gains.text() in out and model.GAIN_LABEL in out  # the speedups the store records, labelled
    assert "2 of 3 tuned shapes launch a faster config: 1.020-1.040x" in out
    # per token count: the heuristic's time of the tuned shapes, and with the stored speedups
    t1 = [line.split() for line in out.splitlines() if re.match(r"\s+1\s+2\s", line)]
    assert t1 and float(t1[0][2]) == pytest.approx(62.0) and float(t1[0][3]) == pytest.approx(50 / 1.04 + 12, abs=0.01)
    assert f"{len(found.jobs) - 3} shapes have no entry" in out
    assert json.loads(out_json.read_text())["gains"]["label"] == model.GAIN_LABEL


def test_the_main_job_without_compute_sanitizer_exits_2_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli.probe, "sanitizer_problem", lambda: "compute-sanitizer not found on PATH")
    monkeypatch.setattr(model, "tune", lambda *a, **k: pytest.fail("tuned without compute-sanitizer"))
    code, out, err = run(capsys, cli.main, "--model", QWEN3_8B, "--mode", "decode")
    assert code == 2 and "compute-sanitizer not found on PATH (see --no-sanitize)" in err


def test_the_main_job_without_a_gpu_exits_3_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(cli, "gpu_problem", lambda: "no CUDA device is visible")
    monkeypatch.setattr(model, "tune", lambda *a, **k: pytest.fail("tuned without a GPU"))
    code, out, err = run(capsys, cli.main, "--model", QWEN3_8B, "--mode", "decode", "--budget-minutes", "10")
    assert code == NO_GPU_EXIT == 3 and out == "" and "needs a CUDA sm_90 GPU" in err


# ---------------------------------------------------------------------------------------------
# Bad input refused before any work


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "gemm_leakyrelu", "--shape", "m=0"], "m=0: sizes are at least 1"),
    (["--kernel", "gemm_leakyrelu", "--shape", "m=-8"], "m=-8: sizes are at least 1"),
    (["--kernel", "gemm_leakyrelu", "--shape", "m=8", "--plan", "--json", "/nonexistent/dir/plan.json"],
     "does not exist"),
    (["--model", QWEN3_8B, "--budget-iters", "5"], "--budget-iters"),
    (["--model", QWEN3_8B, "--cache", QWEN3_8B], "is a file"),
])
def test_sip_tune_refuses_bad_arguments(capsys, no_work, argv, message):
    code, out, err = run(capsys, cli.main, *argv)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": -4096, "num_attention_heads": 32}, "hidden_size must be a positive integer, got -4096"),
    ({"hidden_size": 4096}, "no num_attention_heads"),  # a partial config
    ([LLAMA], "a model config is a JSON object, this file holds a list"),
    (GPT2, "(model_type 'gpt2'): no hidden_size"),
    ('{"hidden_size": 4096,', "not JSON"),
    ({**LLAMA, "num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
])
def test_a_model_config_that_cannot_be_read_is_named_with_the_file_and_the_key(capsys, tmp_path, no_work, config,
                                                                               message):
    path = config_file(tmp_path, config)
    for main, argv in ((cli.main, ["--model", path, "--plan"]), (cli.main, ["--model", path]),
                       (cache_cli.main, ["build", "--model", path, "-o", tmp_path / "out"])):
        code, out, err = run(capsys, main, *argv)
        assert code == 2 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]  # one line of error (after sip-tune's usage)
        assert f"--model {path}" in last and message in last, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_rosekernels_cache_refuses_an_unwritable_output_before_compiling(capsys, tmp_path, no_work, where):
    blocker = config_file(tmp_path, "not a folder", "blocker")
    out = blocker / "cache" if where == "under a file" else Path("/proc/rosekernels-cache")
    code, stdout, err = run(capsys, cache_cli.main, "build", "--model", QWEN3_8B, "-o", out, "--modes", "decode")
    assert code == 2 and f"-o {out}: cannot write a cache there" in err and "Traceback" not in err


def test_a_build_whose_entries_did_not_land_fails(capsys, tmp_path, monkeypatch):
    """Writes that fail during the compile (a full disk) only warn in the compile cache: the build counts
    what landed instead of reporting success."""
    monkeypatch.setattr(jit, "compile_cold", lambda jobs, processes=None, progress=False: [])
    code, out, err = run(capsys, cache_cli.main, "build", "--model", QWEN3_8B, "-o", tmp_path / "c",
                         "--modes", "decode")
    assert code == 1 and "31 of 31 specializations were not written" in err


def test_a_llama_model_gets_no_qk_norm_and_a_qwen3_model_does(tmp_path):
    llama = models.ModelDims.from_config(config_file(tmp_path, LLAMA))
    qwen3 = models.ModelDims.from_config(QWEN3_8B)
    assert not llama.qk_norm and qwen3.qk_norm
    for mode in ("decode", "prefill"):
        found = model.shapes(llama, mode)
        assert "qk_norm" not in {j.kernel for j in found.jobs + [j for j, _ in found.dropped]}
    assert not any(c.variant().op == "qk_norm" for c in startup.model_specs(llama, ("decode",)))
    assert any(c.variant().op == "qk_norm" for c in startup.model_specs(qwen3, ("decode",)))
    assert any(j.kernel == "qk_norm" for j in model.shapes(qwen3, "prefill").jobs)


def test_a_float32_model_says_why_it_has_nothing_to_tune(capsys, tmp_path, no_work):
    path = config_file(tmp_path, {**LLAMA, "torch_dtype": "float32"})
    code, out, err = run(capsys, cli.main, "--model", path, "--mode", "decode", "--plan")
    assert code == 1 and models.FP32_NOTE in out and "nothing to tune" in err


def test_plan_json_writes_the_plan(capsys, tmp_path):
    kernel_json, model_json = tmp_path / "kernel.json", tmp_path / "model.json"
    code, out, err = run(capsys, cli.main, "--kernel", "gemm_leakyrelu", "--mode", "decode", "--shape", "m=8",
                         "--plan", "--json", kernel_json)
    assert code == 0 and f"plan written to {kernel_json}" in out
    plan = json.loads(kernel_json.read_text())
    space = configs.plan("gemm_leakyrelu", "decode", {"m": 8})
    assert plan["searched"] == [configs.describe(c) for c in space.candidates] and plan["candidates"] == space.total
    code, out, err = run(capsys, cli.main, "--model", QWEN3_8B, "--mode", "decode", "--plan", "--json", model_json)
    assert code == 0
    planned = json.loads(model_json.read_text())
    found = model.shapes(models.ModelDims.from_config(QWEN3_8B), "decode")
    assert [s["shape"] for s in planned["shapes"]] == [j.shape for j in found.jobs]
    assert len(planned["dropped"]) == len(found.dropped)


def test_list_counts_the_tuned_configs_and_names_a_file_given_as_the_store(capsys, tmp_path):
    shape = workloads.resolve("gemm_leakyrelu", "decode", {"m": 8})[1]
    heuristic = workloads.resolve("gemm_leakyrelu", "decode", {"m": 8})[0]
    for m in (8, 64):  # two buckets; a level-1 run stores configs, not cubins
        bucket_shape = dataclasses.replace(shape, m=m)
        tuned.store_config(tmp_path, kernel_module("gemm_leakyrelu"), bucket_shape, heuristic, heuristic, "ab" * 32,
                           {"speedup": 1.0, "gpu": "NVIDIA H200"}, toolchain="some-toolchain")
    code, out, err = run(capsys, cli.main, "--list", "--cache", tmp_path)
    assert code == 0 and "2 tuned configs, 0 tuned cubins" in out and "the heuristic stays" in out
    assert "nothing tuned" not in out
    code, out, err = run(capsys, cli.main, "--list", "--cache", QWEN3_8B)
    assert code == 2 and "is a file, not a folder" in err and "does not exist" not in err


# ---------------------------------------------------------------------------------------------
# A cubin out of the compile cache


def _host_object(cubin: bytes) -> bytes:
    """An x86-64 object embedding `cubin` in a fatbin, the way a compile-cache entry's .o does."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<HH", header, 0x10, 1, 62)
    payload = cubin + bytes(-len(cubin) % 8)
    entry = bytearray(64)
    struct.pack_into("<HHIQ", entry, 0, 2, 0x101, 64, len(payload))
    struct.pack_into("<I", entry, 28, 90)
    fatbin = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, 64 + len(payload)) + bytes(entry) + payload
    return bytes(header) + bytes(256) + fatbin + bytes(64)


def test_a_compile_cache_entry_gives_its_cubin_to_the_sass_tools(capsys, tmp_path):
    cubin = compile_cu(CORPUS_SOURCES / "smem_tiled_gemm.cu", tmp_path)
    key = "gemm_leakyrelu-decode-sm_90a-dtype=bf16-tile_n=64"
    folder = tmp_path / "cache" / "jit" / jit.TOOLCHAIN
    folder.mkdir(parents=True)
    obj = folder / f"{key}-{jit.package_digest()}.o"
    obj.write_bytes(_host_object(cubin))
    obj.with_suffix(".json").write_text(json.dumps({"cubin_sha256": hashlib.sha256(cubin).hexdigest()}))
    for spec in ([obj], [key, "--dir", tmp_path / "cache"]):  # its .o, or its key as `list` prints it
        out = tmp_path / "x.cubin"
        code, stdout, err = run(capsys, cache_cli.main, "cubin", *spec, "-o", out)
        assert code == 0, err
        assert out.read_bytes() == cubin and f"sip disasm {out}" in stdout
        out.unlink()
    code, direct, _ = run(capsys, sip_cli.main, "disasm", tmp_path / "smem_tiled_gemm.sm_90a.default.cubin")
    code_o, from_object, err = run(capsys, sip_cli.main, "disasm", obj)
    assert code == code_o == 0 and from_object == direct and "reading the cubin it embeds" in err


# ---------------------------------------------------------------------------------------------
# One no-GPU exit code


def _load(path: Path, name: str):
    sys.path.insert(0, str(path.parent))  # the bench scripts import their siblings by name
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def test_every_front_end_exits_3_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(device, "gpu_problem", lambda: "no CUDA device is visible")
    monkeypatch.setattr(cli, "gpu_problem", device.gpu_problem)
    assert run(capsys, cli.main, "--kernel", "qk_norm", "--budget-minutes", "1")[0] == NO_GPU_EXIT
    report = _load(ROOT / "bench" / "report.py", "report")
    with pytest.raises(SystemExit) as e:
        report.require_gpu()
    assert e.value.code == NO_GPU_EXIT and "needs a CUDA sm_90 GPU" in capsys.readouterr().err
    pytest.importorskip("transformers")
    example = _load(ROOT / "examples" / "qwen3_generate.py", "qwen3_generate")
    monkeypatch.setattr(sys, "argv", ["qwen3_generate.py"])
    with pytest.raises(SystemExit) as e:
        example.main()
    assert e.value.code == NO_GPU_EXIT
    # and every benchmark script that measures on the GPU goes through report.require_gpu
    for script in sorted((ROOT / "bench").glob("*.py")):
        text = script.read_text()
        if "__main__" in text and "torch.cuda" in text:
            assert "report.require_gpu()" in text, script.name


# ---------------------------------------------------------------------------------------------
# What a user meets first


def test_dir_of_the_package_lists_its_own_names():
    names = dir(rosekernels)
    assert "importlib" not in names and "os" not in names
    assert set(rosekernels.__all__) <= set(names)


def _readme_rows():
    section = README.split("## Measured on an H200", 1)[1].split("\n## ", 1)[0]  # with its ### parts
    return [line for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---") and not line.startswith("| op | shape |")]


def test_every_readme_figure_links_a_committed_json():
    rows = _readme_rows()
    assert len(rows) >= 15
    for row in rows:
        links = re.findall(r"\]\((bench/results/[^)]+)\)", row)
        assert links and all(re.search(r"\.json(\.gz)?$", p) and (ROOT / p).is_file() for p in links), row
    for line in README.splitlines():
        if line.startswith("|"):
            assert all(len(cell.strip()) <= 150 for cell in line.strip("|").split("|")), line


def test_the_readme_covers_what_a_new_user_asked():
    assert "sip-tune --model examples/configs/qwen3_8b.json --mode decode --budget-minutes" in README
    assert "rosekernels.gemm(" in README and "rosekernels.gate_up_rows(" in README
    # the MoE and FP8 examples run on the package's own ops and say how far they have been checked
    assert "rosekernels.grouped_gemm(" in README and "rosekernels.moe_experts(" in README
    assert "rosekernels.gemm_fp8(" in README
    assert "# moe_experts: 1.09-1.54x dispatch + torch._grouped_mm in decode" in README
    assert "rosekernels.hf runs it for Qwen3-MoE's experts" in README  # hf.EXPERTS_PATH, said where it is used
    assert "# FP8 (e4m3): first measured on an H100 (below)" in README and "not benchmarked yet" not in README
    assert "13.0 or newer" in README and "13.0-13.3" in README and "12.9" in README  # every driver placed
    assert re.search(r"about \d+ minutes on 2 cores", README)  # the CPU test time
    assert "28 specializations" not in README and "31 specializations" in README
    assert "rosekernels-cache cubin" in README and "3 no sm_90 GPU" in README
    specs = {c.variant() for c in startup.model_specs(QWEN3_8B, ("decode",))}
    assert len(specs) == 31  # the count the README gives for a Qwen3-8B decode build
