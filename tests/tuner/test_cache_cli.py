"""rosekernels-cache build | list | verify, and a warm-up from the built cache in a fresh process that
compiles nothing (CPU: CuTeDSL compiles sm_90a without a GPU)."""
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from rosekernels import cache_cli, jit, startup

MODES = ("decode",)
MAX_TOKENS = 2  # few GEMM decode variants
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rosekernels.cache_cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A config.json of fresh odd sizes: head_dim 64 and as many kv heads as q heads, so that decode
    attention needs one row tile."""
    rng = random.Random(os.urandom(8))
    heads = rng.randint(1, 16)
    config = {"hidden_size": 8 * rng.randint(33, 900), "intermediate_size": 8 * rng.randint(40, 3000),
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": 64,
              "torch_dtype": rng.choice(("bfloat16", "float16")), "model_type": "qwen3"}  # qwen3: has q/k norms
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def built(model, tmp_path_factory):
    """(cache folder, the variant keys the model needs), built by the command in a fresh process."""
    out = tmp_path_factory.mktemp("prebuilt") / "cache"
    done = run_cli("build", "--model", model, "-o", str(out), "--modes", ",".join(MODES),
                   "--max-tokens", str(MAX_TOKENS), "-j", "2")
    assert done.returncode == 0, done.stderr
    keys = sorted({c.variant().key() for c in startup.model_specs(model, MODES, MAX_TOKENS)})
    assert f"{len(keys)} specializations" in done.stdout and f"{len(keys)} compiled" in done.stdout, done.stdout
    return out, keys


@pytest.mark.slow
def test_list_shows_every_entry_with_its_toolchain_and_size(built, capsys):
    out, keys = built
    assert cache_cli.main(["list", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[1:-1]]
    assert sorted(r[-1] for r in rows) == keys
    for kernel, toolchain, size, unit, key in rows:
        assert key.startswith(kernel + "-") and toolchain == jit.TOOLCHAIN and unit == "KiB" and float(size) > 1
    assert lines[-1].startswith(f"{len(keys)} entries")


@pytest.mark.slow
def test_a_fresh_process_warms_up_from_the_cache_with_no_compile(built, model, tmp_path):
    out, keys = built
    assert cache_cli.main(["verify", str(out)]) == 0
    empty = tmp_path / "default-root"
    code = (
        "import json, os, sys, rosekernels\n"
        "from rosekernels import jit\n"
        "kw = dict(model=sys.argv[1], modes=('decode',), max_tokens=int(sys.argv[3]), progress=False)\n"
        "a = rosekernels.warmup(cache_dir=sys.argv[2], **kw)\n"  # the argument...
        "os.environ['ROSEKERNELS_CACHE_DIR'] = sys.argv[2]\n"
        "jit.forget_loaded()\n"
        "b = rosekernels.warmup(**kw)\n"  # ...and the environment
        "print(json.dumps([[a.compiled, a.from_disk], [b.compiled, b.from_disk]]))\n")
    env = {**os.environ, "ROSEKERNELS_CACHE_DIR": str(empty)}
    done = subprocess.run([sys.executable, "-c", code, model, str(out), str(MAX_TOKENS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for compiled, from_disk in json.loads(done.stdout.splitlines()[-1]):
        assert compiled == [] and sorted(from_disk) == keys
    assert not empty.exists()


def flip_cubin_byte(entry: jit.DiskEntry) -> None:
    obj = bytearray(entry.object_path.read_bytes())
    offset, cubin = jit.embedded_cubins(bytes(obj))[0]
    obj[offset + random.randrange(len(cubin) // 4, len(cubin))] ^= 0x5A
    entry.object_path.write_bytes(bytes(obj))


def other_toolchain(entry: jit.DiskEntry) -> None:
    """The whole cache as another toolchain writes it: its folder, and each entry's metadata."""
    other = jit.TOOLCHAIN.replace("-cu", "-cu9")
    folder = entry.object_path.parent.rename(entry.object_path.parent.with_name(other))
    for meta in folder.glob("*.json"):
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "toolchain": other}))


def other_digest(entry: jit.DiskEntry) -> None:
    for path in (entry.object_path, entry.meta_path):
        path.rename(path.with_name(path.name.replace(entry.digest, "0123456789abcdef")))


BREAKS = {
    "cubin byte": (flip_cubin_byte, "does not match the SHA-256"),
    "metadata cut": (lambda e: e.meta_path.write_text(e.meta_path.read_text()[:40]), "unreadable"),
    "object gone": (lambda e: e.object_path.unlink(), "object (.o) is missing"),
    "another toolchain": (other_toolchain, "it would not be loaded here"),
    "another source": (other_digest, "another rosekernels source"),
    "metadata of another toolchain": (lambda e: e.meta_path.write_text(
        e.meta_path.read_text().replace(jit.TOOLCHAIN, "elsewhere")), "its metadata says toolchain elsewhere"),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", BREAKS)
def test_verify_names_a_broken_entry(built, tmp_path, capsys, how):
    out, keys = built
    copy = tmp_path / "cache"
    shutil.copytree(out, copy)
    entries = jit.disk_entries(copy)
    victim = random.choice(entries)
    damage, reason = BREAKS[how]
    damage(victim)
    assert cache_cli.main(["verify", str(copy)]) == 1
    lines = capsys.readouterr().out.splitlines()
    bad = [line for line in lines if line.startswith("BAD")]
    if how == "another toolchain":  # the whole folder moved: every entry is of another toolchain
        assert len(bad) == len(keys) and all(reason in line for line in bad)
    else:
        assert len(bad) == 1 and victim.key in bad[0] and reason in bad[0], lines
    assert lines[-1].startswith(f"{len(keys)} entries: {len(keys) - len(bad)} good, {len(bad)} bad")


def test_bad_input_is_one_line_exit_2_and_writes_nothing(model, tmp_path, capsys):
    out = tmp_path / "out"
    not_json = tmp_path / "config.json"
    not_json.write_text("{hidden_size: 4096")
    no_heads = tmp_path / "no_heads.json"
    no_heads.write_text(json.dumps({"hidden_size": 4096}))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]")
    cases = [
        (["build", "--model", str(tmp_path / "missing.json"), "-o", str(out)], "No such file"),
        (["build", "--model", str(not_json), "-o", str(out)], "not JSON"),
        (["build", "--model", str(no_heads), "-o", str(out)], f"{no_heads} (no model_type): no num_attention_heads"),
        (["build", "--model", str(a_list), "-o", str(out)], f"{a_list}: a model config is a JSON object"),
        # Unwritable: refused before compiling (a build used to compile for minutes and write nothing).
        (["build", "--model", model, "-o", str(busy / "notes.txt" / "cache"), "--modes", "decode"],
         "cannot write a cache there"),
        (["build", "--model", model, "-o", "/proc/rosekernels-cache", "--modes", "decode"],
         "cannot write a cache there"),
        (["cubin", str(tmp_path / "nowhere"), "--dir", str(busy), "-o", str(out / "x.cubin")], "does not exist"),
        (["cubin", "qk_norm-decode-sm_90a", "--dir", str(busy), "-o", str(tmp_path / "x.cubin")], "no entry with"),
        (["build", "--model", model, "-o", str(out), "--modes", "decode,sideways"], "modes are"),
        (["build", "--model", model, "-o", str(out), "--max-tokens", "0"], "at least 1"),
        (["build", "--model", model, "-o", str(busy)], "not a rosekernels cache"),
        (["list", str(tmp_path / "nowhere")], "no such folder"),
        (["verify", str(busy)], "not a rosekernels compile cache"),
        (["verify"], "required"),
    ]
    for argv, message in cases:
        assert cache_cli.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, (argv, captured)
    assert not out.exists() and os.listdir(busy) == ["notes.txt"]


GPU_RUN = """
import json, sys, torch, rosekernels
from rosekernels import jit, modes
from rosekernels.kernels import qk_norm, rmsnorm
from rosekernels.models import ModelDims
model, cache, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
assert modes.sm_count() == 132, "the cache was built for 132 SMs"
report = rosekernels.warmup(model=model, modes=("decode",), max_tokens=max_tokens, cache_dir=cache, progress=False)
d = ModelDims.from_config(model)
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[d.dtype]
g = torch.Generator(device="cuda").manual_seed(int(sys.argv[4]))
rand = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dt)
error = lambda got, want: ((got.double() - want).abs() / (want.abs() + 1)).max().item()  # bf16: ~4e-3
errors = []
with jit.cached_only():  # a call that needed a compile would raise NotCached
    for t in range(1, max_tokens + 1):
        q, k, w = rand(t, d.heads_q, d.head_dim), rand(t, d.heads_kv, d.head_dim), rand(d.head_dim)
        for got, want in zip(rosekernels.qk_norm(q, k, w), qk_norm.reference(q, k, w, w)):
            errors.append(error(got, want))
        x, r, wn = rand(t, d.hidden), rand(t, d.hidden), rand(d.hidden)
        for got, want in zip(rosekernels.rmsnorm(x, wn, residual=r), rmsnorm.reference(x, wn, residual=r)):
            errors.append(error(got, want))
        # The q projection: a GEMM the model runs (gemm_leakyrelu_plan.model_gemms) at any odd size.
        a, b = rand(t, d.hidden), rand(d.heads_q * d.head_dim, d.hidden) / d.hidden ** 0.5
        errors.append(error(rosekernels.gemm(a, b), a.double() @ b.double().T))
torch.cuda.synchronize()
print(json.dumps({"compiled": report.compiled, "from_disk": len(report.from_disk), "max_error": max(errors)}))
"""


@pytest.mark.gpu
def test_a_cache_built_with_no_gpu_visible_serves_the_gpu_with_no_compile(model, tmp_path):
    """Build with the GPU hidden (as on a CPU machine), then warm up and run decode calls on the GPU
    in a fresh process: nothing compiles, and the results are right."""
    out = tmp_path / "cache"
    hidden = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = run_cli("build", "--model", model, "-o", str(out), "--modes", "decode", "--max-tokens", "4", env=hidden)
    assert done.returncode == 0, done.stderr
    assert cache_cli.main(["verify", str(out)]) == 0
    run = subprocess.run([sys.executable, "-c", GPU_RUN, model, str(out), "4", str(random.randrange(1 << 30))],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["compiled"] == [] and result["from_disk"] == len(jit.disk_entries(out))
    assert result["max_error"] < 2e-2, result
