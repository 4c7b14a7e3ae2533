"""Level 1 of sip-tune on the GPU: the config worker (runner.ConfigBench) tells bitwise-equal, merely
correct and wrong candidates apart on real kernels; tune_configs searches qk_norm decode (the heuristic
alone: the A/A pair) and gemm_leakyrelu decode at M = 8 end to end; level 2 anneals the chosen config.

Every test spawns worker processes and the GEMM one compiles a few variants: a few minutes in all."""
import dataclasses
import functools
import math

import pytest
import torch

from rosekernels import paths, tuned
from rosekernels.kernels import gemm_leakyrelu, gemm_leakyrelu_plan, qk_norm
from sip_tune import configs, tuning
from sip_tune.runner import ConfigBench, Runner

pytestmark = pytest.mark.gpu

GEMM_DECODE = {"m": 8, "n": 4096, "k": 4096}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A private tuned store; the compile cache stays shared (workers reuse the parent's compiles)."""
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "sip"))
    tuned.forget_configs()
    yield tmp_path / "sip"
    tuned.forget_configs()


def _zero_outputs(launch, fn, args):
    launch(fn, args)
    args[4].zero_()  # qk_norm's out_q: a wrong result


def _rounded_the_other_way(config, launch, fn, args):
    """A correct result that is not the kernel's: the out_q element whose float64 value lies nearest
    a rounding midpoint goes to its other bf16 neighbour (about half an ulp off, inside the tolerance)."""
    launch(fn, args)
    q, k, wq, wk, out_q = args[:5]
    ref = qk_norm.reference(q, k, wq, wk, config.eps, config.weight_bias)[0]
    away = ref.abs() > out_q.double().abs()  # +1 on the bits of a bf16 value adds an ulp to its magnitude
    other = (out_q.view(torch.int16) + torch.where(away, 1, -1).to(torch.int16)).view(torch.bfloat16)
    err = ((other.double() - ref).abs() / ref.abs()).nan_to_num(math.inf)
    i = int(err.view(-1).argmin())
    out_q.view(-1)[i] = other.view(-1)[i]


@dataclasses.dataclass(frozen=True)
class DoctoredSpace(configs.ConfigSpace):
    """The heuristic's qk_norm decode kernel three times: as is, writing zeros, and with one element
    rounded the other way."""

    def workload(self, i):
        w = super().workload(i)
        doctor = (None, _zero_outputs, functools.partial(_rounded_the_other_way, self.configs[i]))[i]
        if doctor is None:
            return w
        return dataclasses.replace(w, launch=functools.partial(doctor, w.run))


def test_the_config_worker_tells_equal_correct_and_wrong_apart(store):
    space = configs.plan("qk_norm", "decode", {"tokens": 4})
    factory = functools.partial(DoctoredSpace, space.module.workload, space.shape, (space.heuristic,) * 3)
    with Runner(factory, bench=ConfigBench) as runner:
        info = runner.start()
        assert info["base_us"] > 0 and info["configs"] == 3
        wrong = runner.request("test", (1, 7, 4), 120)[1]
        assert wrong["status"] == "incorrect" and not wrong["bitwise"] and "sample 0" in wrong["detail"]
        close = runner.request("test", (2, 7, 4), 120)[1]
        assert close["status"] == "ok" and not close["bitwise"]
        assert 0 < close["max_err"] < qk_norm.tolerance(torch.bfloat16)
        same = runner.request("test", (0, 7, 4), 120)[1]
        assert same["status"] == "ok" and same["bitwise"] and math.isnan(same["max_err"])
        # Timed: the zero-writing one (the third reads its result on the host, which a graph capture refuses).
        kind, timing = runner.request("time", ([1], 10), 300)
        assert kind == "ok" and len(timing["median_us"]) == 3 and all(t > 0 for t in timing["median_us"])
        assert abs(timing["rel"][1] - 1) < 0.05  # the A/A pair: one kernel measured twice
        # Before it is stored: at the tuned shape, the bucket's edge (3 tokens) and the test sizes.
        edge = [dataclasses.replace(space.shape, tokens=3)]
        kind, wrong = runner.request("validate", (1, 8, 50, edge, 2), 300)
        assert kind == "ok" and wrong["status"] == "incorrect" and wrong["detail"].startswith("at the tuned shape")
        kind, same = runner.request("validate", (0, 8, 50, edge, 2), 300)
        assert kind == "ok" and same["status"] == "ok" and same["bitwise"]
        assert same["passed"] == 50 and same["shape_passed"] == same["edges_passed"] == 2


def test_a_level_one_winner_runs_under_compute_sanitizer_as_stored():
    """What level 1 runs before storing a config: its kernel, at the tuned shape and on a few test
    sizes, under the three tools (qk_norm prefill, a config other than the heuristic's)."""
    from sip_tune import probe

    if probe.sanitizer_problem():
        pytest.skip(probe.sanitizer_problem())
    space = configs.plan("qk_norm", "prefill", {"tokens": 300})
    verdicts = probe.sanitize(configs.workload_factory("qk_norm", space.candidates[1], space.shape), None)
    assert verdicts == dict.fromkeys(probe.SANITIZER_TOOLS, "clean")


# Kernels that claim work from an int32 counter or sync on a barrier: a config of each whose launch
# reads it (a persistent attention grid, split KV, split K, the prefill dispatch's grid barrier).
SCRATCH = [("attention", "prefill", {"batch": 2, "seqlen": 2048}, lambda c: c.persistent),
           ("attention_decode", "decode", {"batch": 1, "seqlen_kv": 4096}, lambda c: c.splits > 1),
           ("gemm_leakyrelu", "decode", GEMM_DECODE, lambda c: c.split_k and c.splits > 1),
           ("moe_dispatch", "prefill", {}, lambda c: True)]


@pytest.mark.parametrize("kernel, mode, overrides, pick", SCRATCH, ids=[k for k, *_ in SCRATCH])
def test_the_kernels_leave_their_scratch_zero_as_the_worker_checks(kernel, mode, overrides, pick):
    """The worker refuses a kernel that leaves an integer buffer it found zero set (runner.launch_checked):
    every kernel of the package passes that check on its own, at the shape and on ragged samples."""
    from sip_tune.runner import launch_checked

    space = configs.plan(kernel, mode, overrides, max_candidates=10**6)
    config = next(c for c in space.candidates if pick(c))
    w = configs.workload_factory(kernel, config, space.shape)()
    for n, args in enumerate((w.make_args(1), w.sample(2), w.sample(3))):
        left = launch_checked(w, w.kernel.fn, args)
        assert left or n, "no zeroed scratch at the tuned shape: the config does not read a counter"
        assert not any(bool(flag) for flag in left), (config, n)
        w.check(args)  # the launch did its work


def test_qk_norm_decode_level_one_times_the_heuristic_against_itself(store):
    report = configs.tune_configs("qk_norm", "decode", {"tokens": 1}, samples=4, reps=10, store_root=store)
    assert len(report.candidates) == 1 and report.total == 1 and report.candidates[0]["status"] == "ok"
    assert report.heuristic_us > 0 and 0 <= report.aa_spread < 0.05
    assert report.winner is None and "the heuristic stays" in report.outcome
    [entry] = tuned.config_entries(store, qk_norm)  # recorded: the bucket counts as tuned
    assert str(entry.path) == report.stored and entry.config == entry.heuristic and entry.speedup == 1.0
    assert set(report.shares) == {"compile", "test", "time", "verify"} and sum(report.shares.values()) <= 1
    assert "qk_norm" in report.text()


def test_gemm_decode_level_one_then_level_two_on_the_chosen_config(store):
    # (few validation samples and op-level rounds, no compute-sanitizer run: a winner's entry then stays
    # below the store's bar)
    report = configs.tune_configs("gemm_leakyrelu", "decode", GEMM_DECODE, max_candidates=6, samples=4, reps=20,
                                  retime_reps=40, validation_samples=300, op_rounds=10, sanitize=False,
                                  store_root=store)
    rows = report.candidates
    assert len(rows) == 7 and report.pruned == report.total - 7
    assert all(r["status"] in ("ok", "incorrect", "crash", "timeout") for r in rows[1:])
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 4 and all(r["median_us"] > 0 and math.isfinite(r["rel"]) for r in ok)
    heuristic = gemm_leakyrelu_plan.GemmConfig(**report.heuristic)
    for r in ok[1:]:
        cfg = gemm_leakyrelu_plan.GemmConfig(**r["config"])
        if cfg.splits != heuristic.splits:  # another fp32 summation order: correct, not bitwise
            assert not r["bitwise"] and r["max_err"] <= 1
    assert 0 <= report.aa_spread < 0.05 and report.shares["compile"] > 0
    original = heuristic.variant()
    if report.winner is not None:
        entry = tuned.lookup_config(store, gemm_leakyrelu, configs.chosen(report)[1], heuristic,
                                    gemm_leakyrelu.compile(heuristic).cubin_sha256)
        assert entry is not None and dataclasses.asdict(entry.config) == report.winner
        op = entry.meta["checks"]["op_level"]  # the speedup stored is the public op's, past its A/A
        assert report.speedup == op["speedup"] > max(1.01, 1 + op["aa_spread"]) and op["peer"] == "cublas+leaky_relu"
        assert entry.problems == ["300 of 300 samples passed (the bar: all of at least 10000)",
                                  "compute-sanitizer not run"]
    else:  # the heuristic stays (recorded), unless a check failed to run (nothing recorded)
        assert [e.config for e in tuned.config_entries(store, gemm_leakyrelu)] == [heuristic] * report.settled
    config, shape = configs.chosen(report)
    sass = tuning.tune(configs.workload_factory("gemm_leakyrelu", config, shape),
                       tuning.TuneConfig(budget_iters=20, runs=1, samples=50, retimes=1, sanitize=False),
                       kernel="gemm_leakyrelu", store_root=store, log=lambda m: None)
    assert sass.variant == config.variant().key()
    assert (sass.variant == original.key()) == (report.winner is None or config.variant() == original)
