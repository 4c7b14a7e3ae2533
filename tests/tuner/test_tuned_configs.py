"""Shape buckets and the run-time use of tuned configs: what an op plans when the tuned store has an
entry for its shape's bucket (CPU: the choice, with a compiled heuristic; GPU: the op's launch)."""
import dataclasses
import hashlib
import importlib
import shutil
from types import SimpleNamespace

import pytest
from store_samples import CONFIG_META, checks as entry_checks

import rosekernels
from rosekernels import checks, contract, jit, paths, tuned
from rosekernels.kernels import qk_norm_plan
from rosekernels.startup import warmup

META = CONFIG_META  # meets the store's bar
SMS = 132
SHAPE = qk_norm_plan.QKNormShape(3000)  # prefill on 132 SMs; bucket tokens=4096


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty default tuned store, nothing read or chosen yet."""
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "sip"))
    monkeypatch.delenv(tuned.ALLOW_ENV, raising=False)
    tuned.forget_configs()
    yield tmp_path / "sip"
    tuned.allow_unverified(None)
    tuned.forget_configs()


def qk_norm():
    return importlib.import_module("rosekernels.kernels.qk_norm")


def heuristic_and_other(shape=SHAPE, sms=SMS):
    heuristic = qk_norm_plan.config_for(shape, sms)
    assert heuristic.mode == "prefill"
    return heuristic, next(c for c in qk_norm_plan.candidates(shape, sms) if c.variant() != heuristic.variant())


# ---------------------------------------------------------------------------------------------
# Buckets

def test_bucket_rounds_the_size_fields_up_to_a_power_of_two_and_keeps_the_rest():
    s = qk_norm_plan.QKNormShape(3000, q_heads=40, k_heads=5, head_dim=64, dtype="fp16", eps=1e-5)
    assert contract.bucket(s) == dataclasses.replace(s, tokens=4096)
    for n, b in [(0, 0), (1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192)]:
        assert contract.bucket(dataclasses.replace(s, tokens=n)).tokens == b
    from rosekernels.kernels.attention_decode_plan import DecodeShape
    d = DecodeShape(batch=3, seqlen_q=3, seqlen_kv=5000, heads_q=40)
    assert contract.bucket(d) == dataclasses.replace(d, batch=4, seqlen_kv=8192)  # seqlen_q stays exact


@pytest.mark.parametrize("kernel", sorted(rosekernels.KERNELS))
def test_every_kernel_shape_names_its_size_fields(kernel):
    plan = importlib.import_module(rosekernels.KERNELS[kernel] + "_plan")
    shapes = [v for v in vars(plan).values() if isinstance(v, type) and v.__name__.endswith("Shape")]
    (shape_cls,) = shapes
    fields = {f.name: f for f in dataclasses.fields(shape_cls)}
    assert shape_cls.SIZE_FIELDS and set(shape_cls.SIZE_FIELDS) <= set(fields)
    assert "SIZE_FIELDS" not in fields  # a class attribute, not a per-call field
    shape = shape_cls.defaults("prefill" if kernel == "attention" else "decode")
    assert contract.bucket(contract.bucket(shape)) == contract.bucket(shape)


# ---------------------------------------------------------------------------------------------
# tuned_config: what an op plans

def test_no_entry_gives_the_heuristic_without_compiling(store):
    heuristic, _ = heuristic_and_other()
    loaded = len(jit.loaded_variants())
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic
    assert len(jit.loaded_variants()) == loaded


def test_the_stored_config_is_planned_for_every_shape_of_its_bucket(store):
    """CPU: the heuristic compiled for its hash (qk_norm compiles in about a second), a stored entry."""
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, original, META)
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) == other
    near = dataclasses.replace(SHAPE, tokens=2100)  # same bucket, same heuristic
    assert qk_norm_plan.config_for(near, SMS) == heuristic
    assert tuned.tuned_config(qk_norm(), near, heuristic, SMS) == other
    # Another bucket, or other fields, have no entry.
    for shape in (dataclasses.replace(SHAPE, tokens=5000), dataclasses.replace(SHAPE, q_heads=16)):
        h = qk_norm_plan.config_for(shape, SMS)
        assert tuned.tuned_config(qk_norm(), shape, h, SMS) is h


def test_an_entry_applies_only_where_the_heuristic_picks_the_config_it_was_tuned_against(store):
    """Bucket tokens=8 on 132 SMs: 7 and 8 tokens take the prefill kernel, 5 and 6 the decode one."""
    eight, six = dataclasses.replace(SHAPE, tokens=8), dataclasses.replace(SHAPE, tokens=6)
    heuristic, other = heuristic_and_other(eight)
    decode = qk_norm_plan.config_for(six, SMS)
    assert decode.mode == "decode" and contract.bucket(six) == contract.bucket(eight)
    tuned.store_config(None, qk_norm(), eight, other, heuristic, qk_norm().compile(heuristic).cubin_sha256, META)
    assert tuned.tuned_config(qk_norm(), dataclasses.replace(SHAPE, tokens=7), heuristic, SMS) == other
    assert tuned.tuned_config(qk_norm(), six, decode, SMS) is decode


def test_an_entry_serves_only_where_the_heuristic_picks_its_launch_policy_too(store):
    """attention_decode at batch 1 on 132 SMs: the heuristic splits S_kv = 2881..4096 in 16 chunks and
    2100 in 33, with one compiled kernel (the split count is launch policy, not in the cubin). An
    entry tuned at 4096 was tested only where the heuristic splits in 16 (its bucket's edges), so
    at 2100 the op keeps its heuristic. The kernel module is the plan's, with a compile that hashes
    the variant as ptxas would give one cubin per variant."""
    from rosekernels.kernels import attention_decode_plan as plan

    def compile_variant(cfg):
        return SimpleNamespace(cubin_sha256=hashlib.sha256(cfg.variant().key().encode()).hexdigest())

    module = SimpleNamespace(OP=plan.OP, Config=plan.DecodeConfig, Shape=plan.DecodeShape, compile=compile_variant,
                             candidates=plan.candidates)
    at = [plan.DecodeShape(batch=1, seqlen_kv=s) for s in (4096, 3000, 2100)]
    heuristic, near = plan.config_for(at[0], SMS), plan.config_for(at[2], SMS)
    assert plan.config_for(at[1], SMS) == heuristic and (heuristic.splits, near.splits) == (16, 33)
    assert near.variant() == heuristic.variant() and contract.bucket(at[2]) == contract.bucket(at[0])
    other = next(c for c in plan.candidates(at[0], SMS) if c != heuristic and
                 all(c in plan.candidates(s, SMS) for s in at))
    original = compile_variant(heuristic).cubin_sha256
    tuned.store_config(None, module, at[0], other, heuristic, original, META)
    assert tuned.tuned_config(module, at[1], heuristic, SMS) == other
    assert tuned.tuned_config(module, at[2], near, SMS) is near
    assert tuned.lookup_config(None, module, at[2], near, original) is None
    assert tuned.lookup_config(None, module, at[2], heuristic, original).config == other


def test_the_root_warmup_was_given_is_where_ops_look(store, tmp_path):
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    tuned.store_config(tmp_path / "elsewhere", qk_norm(), SHAPE, other, heuristic, original, META)
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic
    report = warmup([heuristic], store_root=str(tmp_path / "elsewhere"))
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) == other
    assert len(report.configs) == 1 and other.variant().key() in report.configs[0]
    assert other.variant() in [k.variant for k in report.kernels]  # compiled now: no JIT when an op plans it
    assert "config   qk_norm prefill-" in str(report)


def test_warmup_reads_the_entries_another_process_tuned_since(store, tmp_path):
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    theirs, _ = tuned.store_config(tmp_path / "theirs", qk_norm(), SHAPE, other, heuristic, original, META)
    assert warmup([heuristic]).configs == []  # this process reads the store: no entry yet
    mine = store / theirs.relative_to(tmp_path / "theirs")  # another process's sip-tune writes one
    mine.parent.mkdir(parents=True)
    shutil.copyfile(theirs, mine)
    report = warmup([heuristic])
    assert len(report.configs) == 1 and tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) == other


def test_warmup_compiles_only_the_entries_an_op_planning_its_specs_can_be_given(store, recwarn):
    """Two entries of qk_norm prefill: one tuned against the warmed-up heuristic, one for another
    model's heads (another heuristic variant, which no op planning the specs picks): only the first
    is compiled and listed."""
    heuristic, other = heuristic_and_other()
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, qk_norm().compile(heuristic).cubin_sha256, META)
    elsewhere = dataclasses.replace(SHAPE, q_heads=16, k_heads=2)
    h2, o2 = heuristic_and_other(elsewhere)
    assert h2.variant() != heuristic.variant() and h2.mode == heuristic.mode
    tuned.store_config(None, qk_norm(), elsewhere, o2, h2, "ab" * 32, META)  # would be reported stale
    report = warmup([heuristic])
    assert len(report.configs) == 1 and other.variant().key() in report.configs[0]
    assert report.stale_configs == [] and not [w for w in recwarn if "another build" in str(w.message)]
    assert {k.variant for k in report.kernels} == {heuristic.variant(), other.variant()}


def test_an_entry_below_the_bar_gives_the_heuristic_unless_the_user_opts_in(store, monkeypatch):
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    weak = {**META, "checks": entry_checks("config", samples=64)}  # level 1's per-candidate test alone
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, original, weak)
    with pytest.warns(UserWarning, match="below the default bar.*64 of 64 samples"):
        assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic
    monkeypatch.setenv(tuned.ALLOW_ENV, "1")
    tuned.forget_configs()
    with pytest.warns(UserWarning, match="loading it anyway"):
        assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) == other
    monkeypatch.delenv(tuned.ALLOW_ENV)
    tuned.forget_configs()
    report = warmup([heuristic], allow_unverified=True)  # the argument: from now on, ops included
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) == other and len(report.configs) == 1
    tuned.allow_unverified(False)
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic


def test_an_entry_with_malformed_checks_gives_the_heuristic_not_an_exception(store):
    """JSON null where a count or a spread belongs (a hand edit): below the bar, with the reason."""
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    bad = {**META, "speedup": None, "checks": {**META["checks"], "samples": {"run": 10_000, "passed": None},
                                               "op_level": {"speedup": 1.2, "aa_spread": None}}}
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, original, bad)
    with pytest.warns(UserWarning, match="below the default bar.*malformed samples.*malformed op-level"):
        assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, original, META)  # a sound entry replaces it
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) == other


def test_an_entry_not_legal_for_the_exact_shape_is_ignored(store):
    heuristic, _ = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    decode = dataclasses.replace(heuristic, mode="decode", warps=1, rows_per_thread=1)  # not a candidate here
    assert decode not in qk_norm_plan.candidates(SHAPE, SMS)
    tuned.store_config(None, qk_norm(), SHAPE, decode, heuristic, original, META)
    assert tuned.lookup_config(None, qk_norm(), SHAPE, heuristic, original).config == decode
    assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic


def test_an_entry_for_another_build_of_the_heuristic_warns_and_is_ignored(store):
    heuristic, other = heuristic_and_other()
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, "ab" * 32, META)  # not what it compiles to
    with pytest.warns(UserWarning, match="another build"):
        assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic
    with pytest.warns(UserWarning, match="another build"):
        report = warmup([heuristic])
    assert report.configs == [] and len(report.stale_configs) == 1 and "stale" in str(report)


def test_an_entry_of_another_toolchain_warns_and_is_ignored(store):
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, original, META, toolchain="cutedsl-0.0_old")
    with pytest.warns(UserWarning, match="another build"):
        assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic
    assert tuned.config_entries(None, qk_norm()) == []


def test_a_corrupt_entry_warns_and_gives_the_heuristic(store):
    heuristic, other = heuristic_and_other()
    original = qk_norm().compile(heuristic).cubin_sha256
    path, _ = tuned.store_config(None, qk_norm(), SHAPE, other, heuristic, original, META)
    path.write_text('{"format": 1, "kernel": "qk_norm"')
    tuned.forget_configs()
    with pytest.warns(UserWarning, match="ignoring tuned-config entry"):
        assert tuned.tuned_config(qk_norm(), SHAPE, heuristic, SMS) is heuristic


# ---------------------------------------------------------------------------------------------
# The op on a GPU

@pytest.mark.gpu
def test_the_op_launches_the_stored_config_and_is_correct(store, monkeypatch):
    import torch

    from rosekernels import launch, modes

    m = qk_norm()
    sms = modes.sm_count(0)
    shape = qk_norm_plan.QKNormShape(3000)
    heuristic, other = heuristic_and_other(shape, sms)
    assert qk_norm_plan.config_for(dataclasses.replace(shape, tokens=2900), sms) == heuristic
    tuned.store_config(None, qk_norm(), shape, other, heuristic, m.compile(heuristic).cubin_sha256, META)
    launch.forget_plans()  # plans made before the entry was stored would keep the heuristic
    planned = []  # what the op's planning compiles: the config it launches comes last
    compile_config = m.compile
    monkeypatch.setattr(m, "compile", lambda cfg: planned.append(cfg) or compile_config(cfg))
    g = torch.Generator(device="cpu").manual_seed(0)
    q = (torch.randn(2900, 32, 128, generator=g) * 3).to(device="cuda", dtype=torch.bfloat16)  # same bucket
    k = (torch.randn(2900, 8, 128, generator=g) * 3).to(device="cuda", dtype=torch.bfloat16)
    wq, wk = ((torch.randn(128, generator=g) * 0.2 + 1).to(device="cuda", dtype=torch.bfloat16) for _ in "qk")
    out_q, out_k = rosekernels.qk_norm(q, k, wq, wk)  # the op plans with the patched kernel module
    torch.cuda.synchronize()
    assert planned and planned[-1] == other
    for out, ref in zip((out_q, out_k), m.reference(q, k, wq, wk)):
        assert checks.relative_error(out, ref) <= m.tolerance(torch.bfloat16)
    launch.forget_plans()
