"""Simulated annealing (sip.search) on toy problems with known optima: no GPU, no kernels."""
import math
import os
import time

import pytest

from sip import search

N = 9
TARGET = tuple(range(N))


def swap_neighbour(state, rng):
    """Move one element up or down by one: the paper's mutation on a toy permutation."""
    i = rng.randrange(N - 1)
    s = list(state)
    s[i], s[i + 1] = s[i + 1], s[i]
    return tuple(s)


def energy(state):
    """Relative 'time' of a permutation: 1.0 at the optimum, a rugged landscape around it."""
    displacement = sum(abs(v - i) for i, v in enumerate(state))
    bump = 0.004 * sum(1 for i in range(N - 1) if (state[i] + state[i + 1]) % 3 == 0)
    return 1.0 + 0.01 * displacement + bump - 0.004 * sum(1 for i in range(N - 1) if (i + i + 1) % 3 == 0)


START = tuple(reversed(range(N)))


def test_finds_the_optimum_of_a_toy_problem():
    cfg = search.AnnealConfig(t_max=0.05, t_min=1e-4, max_iters=6000)
    result = search.anneal(START, swap_neighbour, energy, cfg, seed=1)
    assert result.best == TARGET and result.best_energy == pytest.approx(1.0)
    assert result.initial_energy == energy(START) > 1.3
    assert result.iterations == 6000
    assert result.top[0][2] == TARGET and [t[0] for t in result.top] == sorted(t[0] for t in result.top)
    assert len({t[1] for t in result.top}) == len(result.top)  # distinct states


def test_same_seed_same_proposals_other_seed_others():
    cfg = search.AnnealConfig(max_iters=300)
    seen = {0: [], 1: [], 2: []}

    def run(seed):
        def e(state):
            seen[seed].append(state)
            return energy(state)
        search.anneal(START, swap_neighbour, e, cfg, seed=seed % 2)
        return seen[seed]

    assert run(0) == run(2)  # seed 0 twice
    assert run(1) != seen[0]


def test_failed_candidates_are_never_accepted_and_the_feedback_is_recorded():
    def e(state):  # e.g. a candidate that crashes or computes garbage: anything putting 8 after 7
        return math.inf if state.index(8) > state.index(7) else energy(state)

    result = search.anneal(START, swap_neighbour, e, search.AnnealConfig(max_iters=2000), seed=3)
    assert all(math.isfinite(s.current) for s in result.steps)
    failed = [s for s in result.steps if not math.isfinite(s.proposed)]
    assert failed and not any(s.accepted for s in failed) and all(s.reward == 0.0 for s in failed)
    # reward (E_{i-1} - E_i) / E_0 of an improving step is positive, of a worsening one negative
    e0 = result.initial_energy
    prev = e0
    for s in result.steps:
        if math.isfinite(s.proposed):
            assert s.reward == pytest.approx((prev - s.proposed) / e0)
        prev = s.current


def test_worse_moves_are_accepted_when_hot_and_not_when_cold():
    def accepted_worse(t):
        cfg = search.AnnealConfig(t_max=t, t_min=t / 1.0001, cooling=1.00000001, max_iters=400)
        r = search.anneal(TARGET, swap_neighbour, energy, cfg, seed=5)
        return sum(s.accepted and s.proposed > r.initial_energy for s in r.steps)

    assert accepted_worse(1.0) > 100
    assert accepted_worse(1e-6) == 0


def test_temperature_schedules():
    cfg = search.AnnealConfig(t_max=0.02, t_min=2e-4, max_iters=100)
    ts = [cfg.temperature(i, 0.0) for i in range(101)]
    assert ts[0] == 0.02 and ts[100] is None
    assert ts[99] > 2e-4 and all(a > b for a, b in zip(ts, ts[1:100]))
    ratio = ts[0] / ts[1]
    assert ratio == pytest.approx((0.02 / 2e-4) ** (1 / 100))  # the derived cooling factor L
    explicit = search.AnnealConfig(t_max=0.02, t_min=2e-4, cooling=2.0)
    temps = [t for t in (explicit.temperature(i, 0.0) for i in range(20)) if t is not None]
    assert len(temps) == 7 and temps[-1] == 0.02 / 64  # stops once T <= T_min, as Algorithm 1
    timed = search.AnnealConfig(max_seconds=10.0)
    assert timed.temperature(0, 5.0) == pytest.approx(math.sqrt(0.02 * 2e-4))
    assert timed.temperature(10**6, 10.0) is None
    assert search.AnnealConfig(max_iters=100, max_seconds=60.0).split(4) == search.AnnealConfig(
        max_iters=25, max_seconds=15.0)


def test_a_time_budget_stops_the_search():
    now = [0.0]

    def clock():
        now[0] += 0.25
        return now[0]

    r = search.anneal(START, swap_neighbour, energy, search.AnnealConfig(max_seconds=10.0), seed=0, clock=clock)
    assert 10 <= r.iterations <= 40


def test_no_legal_move_ends_the_run():
    r = search.anneal(START, lambda s, rng: None, energy, search.AnnealConfig(max_iters=50), seed=0)
    assert r.iterations == 0 and r.best == START


@pytest.mark.parametrize("kwargs", [dict(t_max=0.01, t_min=0.02, max_iters=5), dict(cooling=1.0, max_iters=5),
                                    dict(), dict(max_iters=0), dict(max_seconds=0.0)])
def test_bad_configs_are_refused(kwargs):
    with pytest.raises(ValueError):
        search.AnnealConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# The tune loop (sip.tuning.tune) end to end on the CPU: a toy engine, a fake GPU worker.

class ToyEngine:
    """Schedules are permutations of 8 slots; a 'cubin' spells the permutation in its code bytes."""

    @staticmethod
    def cubin(perm):
        from test_sip_cache import make_cubin

        return make_cubin(text=b"".join(bytes([v]) * 8 for v in perm))

    @staticmethod
    def perm(cubin):
        return tuple(cubin[64:128:8])

    @staticmethod
    def rel(perm):
        """Time relative to the original (reversed) order; the sorted order is 1.32x faster."""
        disp = lambda p: sum(abs(v - i) for i, v in enumerate(p))  # noqa: E731
        return (1 + 0.01 * disp(perm)) / (1 + 0.01 * disp(tuple(reversed(range(8)))))


class FakeRunner:
    """The Runner API, timing and testing toy cubins: perm[0] == 3 computes garbage, 6 before 7 at
    the front crashes, and the sorted order fails final validation."""

    instances = []

    def __init__(self, factory, options, log=None):
        self.crashes = self.timeouts = self.starts = 0
        self.evaluated = []
        FakeRunner.instances.append(self)

    def start(self):
        self.starts += 1
        return {"gpu": "Fake H200", "base_us": 2.0, "launches_per_graph": 500, "input_sets": 200,
                "bytes_cycled": 100 << 20}

    def restart(self):
        self.start()

    def close(self):
        pass

    def evaluate(self, cubin, seed, samples=2):
        from sip.runner import Evaluation

        p = ToyEngine.perm(cubin)
        self.evaluated.append(p)
        if p[:2] == (6, 7):
            self.crashes += 1
            return Evaluation("crash", math.inf, detail="illegal address")
        if p[0] == 3:
            return Evaluation("incorrect", math.inf, detail="output 0 differs")
        return Evaluation("ok", ToyEngine.rel(p), 2.0 * ToyEngine.rel(p), 2.0, 0.005, 0.002, 0.02, 0.03)

    def compare(self, cubins, reps):
        rels = [1.0] + [ToyEngine.rel(ToyEngine.perm(c)) for c in cubins]
        return {"median_us": [2.0 * r for r in rels], "rel": rels}

    def validate(self, cubin, seed, samples):
        bad = ToyEngine.perm(cubin) == tuple(range(8))  # the best-looking schedule fails a rare case
        return {"status": "incorrect" if bad else "ok", "passed": 17 if bad else samples, "failed": bad,
                "seconds": 0.1, "detail": ""}


@pytest.fixture
def toy(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from sip import cache, tuning
    from test_sip_cache import FakeVariant

    original = ToyEngine.cubin(tuple(reversed(range(8))))
    monkeypatch.setattr(cache, "current_toolchain", lambda: "test-toolchain")
    monkeypatch.setattr(tuning, "Runner", FakeRunner)
    monkeypatch.setattr(tuning, "engine_initial", ToyEngine.perm)
    monkeypatch.setattr(tuning, "engine_apply", ToyEngine.cubin)
    monkeypatch.setattr(tuning, "engine_stats", lambda s: (8, 8, 14))
    monkeypatch.setattr(tuning, "engine_neighbour", lambda s, rng: swap_neighbour_8(s, rng))
    kernel = SimpleNamespace(cubin=original, variant=FakeVariant("toy", hidden=8))
    FakeRunner.instances = []
    return lambda: SimpleNamespace(kernel=kernel, name="toy"), tmp_path


def swap_neighbour_8(state, rng):
    i = rng.randrange(7)
    s = list(state)
    s[i], s[i + 1] = s[i + 1], s[i]
    return tuple(s)


def test_tune_finds_validates_and_caches_the_best_schedule(toy):
    from sip import cache, tuning

    factory, root = toy
    config = tuning.TuneConfig(budget_iters=3000, runs=2, samples=500, seed=4, finalists=4, exhausted_after=10**6)
    report = tuning.tune(factory, config, cache_root=root, log=lambda m: None)
    assert report.iterations == 3000 and len(report.runs) == 2
    ran = FakeRunner.instances[0].evaluated
    assert report.evaluated == len(ran) == len(set(ran))  # each distinct cubin ran once
    assert report.incorrect > 0 and report.crashed == sum(p[:2] == (6, 7) for p in ran) > 0
    # the sorted order is fastest but fails validation: the next one wins
    rels = [f["rel"] for f in report.finalists]
    assert rels == sorted(rels) and report.finalists[0]["validation"].startswith("incorrect")
    assert report.speedup == pytest.approx(1 / report.finalists[1]["rel"]) and report.speedup > 1.2
    entry = cache.lookup(root, "toy", factory().kernel.variant, factory().kernel.cubin)
    assert entry is not None and report.cached == str(entry.path)
    assert ToyEngine.perm(entry.tuned) != tuple(range(8))
    assert entry.meta["samples_passed"] == 500 and entry.meta["seed"] == 4 and entry.meta["gpu"] == "Fake H200"
    assert entry.meta["speedup"] == pytest.approx(report.speedup)
    assert "cached" in report.outcome and f"{report.crashed} crashed" in report.text()


def test_tune_is_reproducible_by_seed(toy):
    from sip import tuning

    factory, root = toy
    config = tuning.TuneConfig(budget_iters=300, runs=2, samples=10, seed=9)
    a = tuning.tune(factory, config, cache_root=root / "a", log=lambda m: None)
    b = tuning.tune(factory, config, cache_root=root / "b", log=lambda m: None)
    assert FakeRunner.instances[0].evaluated == FakeRunner.instances[1].evaluated
    assert [r["best_rel"] for r in a.runs] == [r["best_rel"] for r in b.runs]
    c = tuning.tune(factory, tuning.TuneConfig(budget_iters=300, runs=2, samples=10, seed=10),
                    cache_root=root / "c", log=lambda m: None)
    assert FakeRunner.instances[2].evaluated != FakeRunner.instances[0].evaluated
    assert c.iterations == 300


def test_tune_caches_nothing_below_the_required_speedup(toy):
    from sip import cache, tuning

    factory, root = toy
    report = tuning.tune(factory, tuning.TuneConfig(budget_iters=200, runs=1, samples=10, min_speedup=2.0),
                         cache_root=root, log=lambda m: None)
    assert not report.cached and "nothing cached" in report.outcome
    assert all(f["validation"].startswith("skipped") for f in report.finalists)
    assert cache.list_entries(root) == []


# ---------------------------------------------------------------------------------------------
# The worker process (sip.runner.Runner) on the CPU: a stand-in for the GPU bench that can crash.

def cpu_workload():
    return "cpu"


class CpuBench:
    """Answers like the GPU bench; some cubins kill the process, raise (a poisoned CUDA context),
    or hang."""

    def __init__(self, workload, options):
        assert workload == "cpu"

    def info(self):
        return {"gpu": "cpu", "pid": os.getpid()}

    def eval(self, cubin, seed, samples):
        if cubin == b"segfault":
            os._exit(139)
        if cubin == b"raise":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if cubin == b"hang":
            time.sleep(600)
        if cubin == b"wrong":
            return {"status": "incorrect", "rel": math.inf, "detail": "sample 0: output 0 differs"}
        return {"status": "ok", "rel": 1.0 - len(cubin) / 100, "cand_us": 1.0, "base_us": 1.0,
                "recycle": cubin == b"full"}

    def validate(self, cubin, seed, samples):
        return {"status": "ok", "passed": samples, "failed": False, "seconds": 0.0, "detail": ""}

    def compare(self, cubins, reps):
        return {"median_us": [1.0] * (len(cubins) + 1), "rel": [1.0] * (len(cubins) + 1)}


def test_worker_crashes_and_hangs_are_contained_and_the_worker_restarts():
    from sip.runner import Options, Runner

    options = Options(eval_timeout_s=3.0, start_timeout_s=120.0)
    logs = []
    with Runner(cpu_workload, options, log=logs.append, bench=CpuBench) as runner:
        pid = runner.start()["pid"]
        assert runner.evaluate(b"ab", seed=0).rel == pytest.approx(0.98)
        wrong = runner.evaluate(b"wrong", seed=0)
        assert wrong.status == "incorrect" and math.isinf(wrong.rel) and runner.starts == 1
        for bad, status in ((b"segfault", "crash"), (b"raise", "crash"), (b"hang", "timeout")):
            ev = runner.evaluate(bad, seed=0)
            assert ev.status == status and math.isinf(ev.rel) and not ev.ok, ev
            ok = runner.evaluate(b"abc", seed=0)  # the next request gets a new worker
            assert ok.ok and ok.rel == pytest.approx(0.97)
            assert runner.info["pid"] != pid
            pid = runner.info["pid"]
        assert "illegal memory access" in runner.evaluate(b"raise", seed=0).detail
        assert runner.crashes == 3 and runner.timeouts == 1 and runner.starts == 4
        runner.evaluate(b"full", seed=0)  # a new worker (5), which says its memory is filling up: another
        assert runner.starts == 6
    assert any("timeout" in m for m in logs) and any("crash" in m for m in logs)


def broken_workload():
    raise LookupError("no such kernel")


def test_a_worker_that_cannot_set_up_is_a_clear_error():
    from sip.runner import Runner, WorkerFailure

    with pytest.raises(WorkerFailure, match="could not set up the kernel.*no such kernel"):
        with Runner(broken_workload, bench=CpuBench) as runner:
            runner.start()


def test_a_run_ends_early_once_nothing_new_is_proposed(toy):
    from sip import tuning

    factory, root = toy
    config = tuning.TuneConfig(budget_iters=20000, runs=1, samples=10, t_min=1e-6, exhausted_after=40)
    report = tuning.tune(factory, config, cache_root=root, log=lambda m: None)
    (run,) = report.runs
    assert run["exhausted"] and run["iterations"] < 20000 and "ended early" in report.text()


def test_a_kernel_without_legal_moves_is_not_searched(toy, monkeypatch):
    from sip import tuning

    factory, root = toy
    monkeypatch.setattr(tuning, "engine_stats", lambda s: (8, 0, 0))
    report = tuning.tune(factory, tuning.TuneConfig(budget_iters=100), cache_root=root, log=lambda m: None)
    assert "no legal move" in report.outcome and report.iterations == 0 and not FakeRunner.instances
