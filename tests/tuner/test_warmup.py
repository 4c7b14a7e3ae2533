"""rosekernels.warmup: on top of the tuned store, for a model, in parallel processes (CPU: compile and
load, no launch)."""
import os
import random
import shutil

import axpb_kernel
import jit_demo_kernel as demo
import pytest
from store_samples import META, checks

import rosekernels.kernels
from rosekernels import jit, launch, paths, startup, tuned
from rosekernels.kernels import gemm_leakyrelu_plan as gemm_plan
from rosekernels.models import ModelDims
from rosekernels.startup import warmup
from sip.mutate import with_extra_stalls

VARIANT = axpb_kernel.Config("decode").variant()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Private compile and tuned-store roots; the demo kernel registered as a kernel module."""
    monkeypatch.setenv(paths.COMPILE_CACHE_ENV, str(tmp_path / "rk"))
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "sip"))
    monkeypatch.setitem(rosekernels.kernels.KERNELS, axpb_kernel.OP, "axpb_kernel")
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()
    yield
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()
    tuned.allow_unverified(None)  # warmup(allow_unverified=...) sets it for the process


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


def test_warmup_loads_the_shipped_entries_unless_told_not_to(env, tmp_path, monkeypatch):
    """An entry under the package's shipped root loads with an empty store (and leaves no lock file in the
    package); warmup(shipped=False), as the tuner's own measurements call it, loads none."""
    monkeypatch.setattr(tuned, "SHIPPED_ROOT", tmp_path / "shipped")
    untuned = compile_demo()
    path, _ = tuned.store(tuned.SHIPPED_ROOT, "axpb", VARIANT, untuned.cubin, with_extra_stalls(untuned.cubin), META)
    (path / ".lock").unlink()  # store's own; a reader must not make one
    jit.forget_loaded()
    assert warmup([compile_demo], shipped=False).untuned == [VARIANT.key()]
    jit.forget_loaded()
    report = warmup([compile_demo])
    assert report.tuned == [VARIANT.key()] and report.kernels[0].tuned
    assert not (path / ".lock").exists()


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


def test_warmup_loads_an_entry_below_the_bar_only_when_the_user_opts_in(env, monkeypatch):
    monkeypatch.delenv(tuned.ALLOW_ENV, raising=False)
    k = compile_demo()
    weak = {**META, "checks": checks(speedup=1.002, aa=0.004)}  # an op-level gain inside its A/A spread
    tuned.store(None, "axpb", VARIANT, k.cubin, with_extra_stalls(k.cubin), weak)
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="below the default bar.*not loaded"):
        report = warmup([compile_demo])
    assert report.untuned == [VARIANT.key()] and report.stale == [] and not report.kernels[0].tuned
    assert report.unverified == [f"{VARIANT.key()}: op-level 1.0020x the original, not past 1 + its A/A spread "
                                 "0.0040"]
    assert "below the bar (not loaded)" in str(report)
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="loading it anyway"):
        report = warmup([compile_demo], allow_unverified=True)
    assert report.tuned == [VARIANT.key()] and report.kernels[0].tuned and report.loaded_unverified
    assert "below the bar (loaded: allow_unverified)" in str(report)


def test_withdrawing_the_opt_in_unloads_what_it_loaded(env, monkeypatch):
    """After allow_unverified(False), or a warmup with allow_unverified=False, no op keeps a plan or a
    loaded kernel that the opt-in gave it, and warmup reports the kernel untuned."""
    monkeypatch.delenv(tuned.ALLOW_ENV, raising=False)
    k = compile_demo()
    stalled = with_extra_stalls(k.cubin)
    tuned.store(None, "axpb", VARIANT, k.cubin, stalled, {**META, "checks": checks(speedup=1.002, aa=0.004)})
    plans = launch.PlanCache()
    for withdraw in (lambda: tuned.allow_unverified(False), lambda: warmup([compile_demo], allow_unverified=False)):
        jit.forget_loaded()
        monkeypatch.setattr(tuned, "_reported", set())  # each warned about once per process
        with pytest.warns(UserWarning, match="loading it anyway"):
            assert warmup([compile_demo], allow_unverified=True).tuned == [VARIANT.key()]
        plans.put(("signature",), "a plan made with the below-bar kernel")
        with pytest.warns(UserWarning, match="not loaded"):
            withdraw()
            report = warmup([compile_demo])
        assert plans.get(("signature",)) is None
        assert report.untuned == [VARIANT.key()] and not report.kernels[0].tuned and not compile_demo().tuned
        assert stalled not in jit.swap_cubins(k.object_bytes)[0]


def test_opting_in_drops_the_plans_made_under_the_bar(env, monkeypatch):
    """A plan made before the opt-in kept the heuristic's config where an entry below the bar had
    another: opting in, as withdrawing, makes every op plan again."""
    monkeypatch.delenv(tuned.ALLOW_ENV, raising=False)
    tuned.allow_unverified(None)
    plans = launch.PlanCache()
    plans.put(("signature",), "a plan that kept the heuristic's config")
    tuned.allow_unverified(True)
    assert plans.get(("signature",)) is None


def test_warmup_refuses_a_tuned_cubin_changed_outside_its_code(env):
    """Written past the store (an older sip-tune, a hand edit): one byte of the symbol table differs."""
    import json

    from sip import cubin

    k = compile_demo()
    faster = with_extra_stalls(k.cubin)
    path, _ = tuned.store(None, "axpb", VARIANT, k.cubin, faster, META)
    symtab = next(sec for sec in cubin.parse_cubin(faster).sections if sec.name == ".symtab")
    bad = bytearray(faster)
    bad[symtab.offset + 24 + 16] ^= 1  # a symbol's size
    (path / "tuned.cubin").write_bytes(bytes(bad))
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "tuned_sha256": tuned.sha256(bytes(bad))}))
    jit.forget_loaded()
    with pytest.warns(UserWarning, match="outside .*'s code.*section .symtab"):
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
    with pytest.raises(ValueError, match="no kernel module for 'nope'"):
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


# ---------------------------------------------------------------------------------------------
# warmup(model=...): what a model needs, cold variants compiled in worker processes.


def random_model(rng: random.Random) -> dict:
    """A Hugging Face config dict of odd sizes every kernel takes (multiples of 8, head dims 64/128)."""
    heads_kv = rng.randint(1, 8)
    return {"hidden_size": 8 * rng.randint(33, 700), "intermediate_size": 8 * rng.randint(40, 2000),
            "num_attention_heads": heads_kv * rng.choice((1, 2, 4, 8)), "num_key_value_heads": heads_kv,
            "head_dim": rng.choice((64, 128)), "torch_dtype": rng.choice(("bfloat16", "float16"))}


@pytest.fixture
def demo_only(env, monkeypatch):
    """The demo kernel as the package's only kernel module: warmup(model=...) compiles two cheap variants."""
    monkeypatch.setattr(rosekernels.kernels, "KERNELS", {axpb_kernel.OP: "axpb_kernel"})


def test_a_model_compiles_in_worker_processes_then_loads_from_disk(demo_only):
    model = random_model(random.Random(os.urandom(8)))
    keys = sorted(axpb_kernel.Config(m).variant().key() for m in ("decode", "prefill"))
    first = warmup(model=model, processes=2)
    assert sorted(first.compiled) == keys and first.from_disk == []
    assert "2 compiled, 0 loaded from disk, 0 already loaded" in str(first)
    assert sorted(e.key for e in jit.disk_entries(paths.compile_cache_root())) == keys  # written by the workers
    jit.forget_loaded()
    second = warmup(model=model)
    assert second.compiled == [] and sorted(second.from_disk) == keys
    third = warmup(model=model, modes=("decode",))
    assert [k.variant.key() for k in third.kernels] == [axpb_kernel.Config("decode").variant().key()]
    assert third.compiled == third.from_disk == [] and "1 already loaded" in str(third)


def test_cache_dir_is_the_compile_cache_root_and_holds_the_tuned_store(env, tmp_path, monkeypatch):
    monkeypatch.delenv(paths.TUNED_STORE_ENV)
    prebuilt = tmp_path / "prebuilt"
    original = compile_demo().cubin  # into the default root
    tuned.store(prebuilt / "sip", "axpb", VARIANT, original, with_extra_stalls(original), META)
    jit.forget_loaded()
    report = warmup([VARIANT], cache_dir=prebuilt, processes=1)
    assert report.compiled == [VARIANT.key()] and report.tuned == [VARIANT.key()]
    assert [e.key for e in jit.disk_entries(prebuilt)] == [VARIANT.key()]
    shutil.rmtree(tmp_path / "rk")  # the default root
    jit.forget_loaded()
    with jit.cached_only():
        assert compile_demo().tuned  # later compiles load from the root warmup was given
    jit.forget_loaded()
    assert warmup([VARIANT]).compiled == [VARIANT.key()]  # cache_dir None: the default root again
    assert [e.key for e in jit.disk_entries(tmp_path / "rk")] == [VARIANT.key()]


def test_store_root_names_the_tuned_store_and_tuned_dir_is_its_deprecated_name(env, tmp_path):
    original = compile_demo().cubin
    tuned.store(tmp_path / "elsewhere", "axpb", VARIANT, original, with_extra_stalls(original), META)
    jit.forget_loaded()
    assert warmup([VARIANT]).tuned == []  # not in the environment's store
    jit.forget_loaded()
    assert warmup([VARIANT], store_root=tmp_path / "elsewhere").tuned == [VARIANT.key()]
    assert paths.tuned_store_root() == tmp_path / "elsewhere"  # the ops look there from now on
    jit.forget_loaded()
    jit.uninstall_tuned_cubins()
    with pytest.warns(DeprecationWarning, match="pass store_root"):
        assert warmup([VARIANT], tuned_dir=tmp_path / "elsewhere").tuned == [VARIANT.key()]
    with pytest.raises(TypeError, match="not both"):
        warmup([VARIANT], store_root=tmp_path, tuned_dir=tmp_path)


def test_max_tokens_bounds_the_token_counts_of_the_warmup_set():
    rng = random.Random(os.urandom(8))
    model = random_model(rng)
    dims = ModelDims.from_config(model)
    everything = startup.model_specs(model)
    gemms = gemm_plan.model_gemms(dims)
    prefill_tiles = {gemm_plan.GemmConfig(dtype=dims.dtype, activation=act, gated=gated, tile_m=tm, tile_n=tn,
                                          pingpong=pp).variant()
                     for _, n, k, act, gated in gemms for tm, tn, pp, _ in gemm_plan.PREFILL_TILES}
    for max_tokens in (rng.randint(1, gemm_plan.DECODE_MAX_M), rng.randint(gemm_plan.DECODE_MAX_M + 1, 40000)):
        bounded = startup.model_specs(model, max_tokens=max_tokens)
        assert set(bounded) <= set(everything)
        # decode: the pick at every count up to max_tokens; prefill: every tile, whatever the length
        expected = {gemm_plan.config_for(gemm_plan.GemmShape(m, n, k, dtype=dims.dtype, activation=act,
                                                            gated=gated)).variant()
                    for m in range(1, min(max_tokens, gemm_plan.DECODE_MAX_M) + 1) for _, n, k, act, gated in gemms}
        if max_tokens > gemm_plan.DECODE_MAX_M:
            expected |= prefill_tiles
        assert {c.variant() for c in bounded if c.variant().op == "gemm_leakyrelu"} == expected, (model, max_tokens)
        others = [c for c in everything if c.variant().op != "gemm_leakyrelu"]  # drawn from no token counts
        assert [c for c in bounded if c.variant().op != "gemm_leakyrelu"] == others
    assert not any(c.variant().mode == "prefill" and c.variant().op == "gemm_leakyrelu"
                   for c in startup.model_specs(model, ("prefill",), gemm_plan.DECODE_MAX_M))
    # a prefill call of any length finds its pick in the set
    m = rng.randint(gemm_plan.DECODE_MAX_M + 1, 100000)
    _, n, k, act, gated = rng.choice(gemms)
    pick = gemm_plan.config_for(gemm_plan.GemmShape(m, n, k, dtype=dims.dtype, activation=act, gated=gated))
    assert pick.variant() in {c.variant() for c in everything}


def test_bad_model_arguments_are_named(env, tmp_path):
    model = random_model(random.Random(1))
    with pytest.raises(TypeError, match="specs or model"):
        warmup()
    with pytest.raises(ValueError, match="modes must be"):
        warmup(model=model, modes=("decode", "sideways"))
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        warmup(model=model, max_tokens=0)
    with pytest.raises(FileNotFoundError):
        warmup(model=str(tmp_path / "missing.json"))


def test_compile_processes_follow_cores_jobs_and_memory(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    for memory, expected in ((None, cores), (3 * jit.COMPILE_PEAK_BYTES + 1, min(cores, 3)), (0, 1)):
        monkeypatch.setattr(jit, "_available_memory", lambda m=memory: m)
        assert jit.compile_processes(1000) == expected
        assert jit.compile_processes(1) == 1
