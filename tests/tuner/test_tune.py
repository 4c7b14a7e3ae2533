"""The tuner on the CPU: the tune loop (sip_tune.tuning.tune) end to end with a toy engine and a fake
GPU worker, and the worker process (sip_tune.runner.Runner) with a stand-in bench that crashes and hangs."""
import dataclasses
import math
import os
import time
from types import SimpleNamespace

import pytest
from sip_corpus import corpus, corpus_entry  # noqa: F401
from store_samples import FakeVariant, make_cubin

from rosekernels import tuned
from sip import cli as sip_cli
from sip_tune import oplevel, tuning
from sip_tune.runner import Evaluation, Options, Runner, WorkerFailure, _set_bytes


# ---------------------------------------------------------------------------------------------
# The tune loop: a toy engine, a fake GPU worker.

class ToyEngine:
    """Schedules are permutations of 8 slots; a 'cubin' spells the permutation in its code bytes."""

    @staticmethod
    def cubin(perm):
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
        self.device = options.device
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

    def validate(self, cubin, seed, samples, shape_samples=0):
        bad = ToyEngine.perm(cubin) == tuple(range(8))  # the best-looking schedule fails a rare case
        return {"status": "incorrect" if bad else "ok", "passed": 17 if bad else samples, "failed": bad,
                "shape_passed": shape_samples, "seconds": 0.1, "detail": ""}


@pytest.fixture
def toy(monkeypatch, tmp_path):
    original = ToyEngine.cubin(tuple(reversed(range(8))))
    monkeypatch.setattr(tuned, "current_toolchain", lambda: "test-toolchain")
    monkeypatch.setattr(tuning, "Runner", FakeRunner)
    monkeypatch.setattr(tuning, "_gpu_count", lambda: 1)
    monkeypatch.setattr(tuning, "engine_initial", ToyEngine.perm)
    monkeypatch.setattr(tuning, "engine_apply", ToyEngine.cubin)
    monkeypatch.setattr(tuning, "engine_stats", lambda s: (8, 8, 14))
    monkeypatch.setattr(tuning, "engine_neighbour", lambda s, rng: swap_neighbour_8(s, rng))
    monkeypatch.setattr(tuning.probe, "sanitizer_problem", lambda: None)
    monkeypatch.setattr(tuning.probe, "sanitize", lambda factory, cubin: dict.fromkeys(tuning.probe.SANITIZER_TOOLS,
                                                                                        "clean"))
    kernel = SimpleNamespace(cubin=original, variant=FakeVariant("toy", hidden=8))
    FakeRunner.instances = []
    return lambda: SimpleNamespace(kernel=kernel, name="toy"), tmp_path


def swap_neighbour_8(state, rng):
    i = rng.randrange(7)
    s = list(state)
    s[i], s[i + 1] = s[i + 1], s[i]
    return tuple(s)


def test_tune_finds_validates_and_caches_the_best_schedule(toy):
    factory, root = toy
    config = tuning.TuneConfig(budget_iters=3000, runs=2, samples=500, seed=4, finalists=4, exhausted_after=10**6)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert report.iterations == 3000 and len(report.runs) == 2
    ran = FakeRunner.instances[0].evaluated
    assert report.evaluated == len(ran) == len(set(ran))  # each distinct cubin ran once
    assert report.incorrect > 0 and report.crashed == sum(p[:2] == (6, 7) for p in ran) > 0
    # the sorted order is fastest but fails validation: the next one wins
    rels = [f["rel"] for f in report.finalists]
    assert rels == sorted(rels) and report.finalists[0]["validation"].startswith("incorrect")
    assert report.speedup == pytest.approx(1 / report.finalists[1]["rel"]) and report.speedup > 1.2
    entry = tuned.lookup(root, "toy", factory().kernel.variant, factory().kernel.cubin)
    assert entry is not None and report.cached == str(entry.path)
    assert ToyEngine.perm(entry.tuned) != tuple(range(8))
    assert entry.meta["samples_passed"] == 500 and entry.meta["seed"] == 4 and entry.meta["gpu"] == "Fake H200"
    assert entry.meta["speedup"] == pytest.approx(report.speedup)
    assert "cached" in report.outcome and f"{report.crashed} crashed" in report.text()


def test_the_runs_can_start_from_the_floor_of_the_stall_counts(toy, monkeypatch):
    """start='floor': each run starts at the floor schedule (a toy one here, 1.2x faster than the
    original), so the first cubin measured is the floor's, and it competes as a finalist like any
    schedule a walk finds; runs from the original never measure it first."""
    factory, root = toy
    floor = (1, 0, 2, 3, 4, 5, 7, 6)
    monkeypatch.setattr(tuning, "engine_initial", lambda cubin, moves: ToyEngine.perm(cubin))
    monkeypatch.setattr(tuning, "engine_floor", lambda cubin: ToyEngine.cubin(floor))
    monkeypatch.setattr(tuning, "engine_neighbour", lambda s, rng: None)  # no move: the runs stay at their start
    config = tuning.TuneConfig(budget_iters=50, runs=2, samples=500, seed=4, moves="control", start="floor")
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert FakeRunner.instances[0].evaluated[0] == floor
    assert [f["digest"] for f in report.finalists] == [tuning._digest(ToyEngine.cubin(floor))]
    assert report.speedup == pytest.approx(1 / ToyEngine.rel(floor)) and report.cached
    assert report.config["start"] == "floor" and report.start_sha256 == tuning._digest(ToyEngine.cubin(floor))
    # the winner is the start itself: its whole gain is the floor's, none the search's
    assert report.start_speedup == pytest.approx(1 / ToyEngine.rel(floor))
    assert report.finalists[0]["over_start"] == pytest.approx(1.0) and "(the start itself)" in report.text()
    assert tuned.lookup(root, "toy", factory().kernel.variant, factory().kernel.cubin).meta["start"] == {
        "sha256": report.start_sha256, "speedup": pytest.approx(report.start_speedup), "over_start": pytest.approx(1),
        "from": "floor"}
    FakeRunner.instances = []
    report = tuning.tune(factory, dataclasses.replace(config, start="original"), store_root=root / "o",
                         log=lambda m: None)
    assert floor not in FakeRunner.instances[0].evaluated and not report.finalists


def test_a_search_from_the_floor_reports_its_gain_over_the_start_timed_beside_the_finalists(toy, monkeypatch):
    """Where the floor is not a finalist, the final re-times run it too (the last cubin compared), so that
    each finalist's gain over the start comes from the same runs as its gain over the original."""
    factory, root = toy
    floor = (6, 5, 7, 4, 3, 2, 1, 0)  # slower than what the walks reach: not a finalist
    monkeypatch.setattr(tuning, "engine_initial", lambda cubin, moves: ToyEngine.perm(cubin))
    monkeypatch.setattr(tuning, "engine_floor", lambda cubin: ToyEngine.cubin(floor))
    compared = []
    compare = FakeRunner.compare
    monkeypatch.setattr(FakeRunner, "compare", lambda self, cubins, reps: compared.append(cubins) or compare(
        self, cubins, reps))
    config = tuning.TuneConfig(budget_iters=3000, runs=2, samples=500, seed=4, finalists=3, moves="control",
                               start="floor", exhausted_after=10**6)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert report.start_sha256 not in {f["digest"] for f in report.finalists}
    assert all(ToyEngine.perm(c[-1]) == floor and len(c) == 1 + len(report.finalists) + 1 for c in compared)
    assert report.start_speedup == pytest.approx(1 / ToyEngine.rel(floor))
    for f in report.finalists:
        assert f["over_start"] == pytest.approx(ToyEngine.rel(floor) / f["rel"]) and f["over_start"] > 1
    assert "x the start" in report.text()


def test_no_iteration_from_the_floor_checks_and_stores_the_floor_itself(toy, monkeypatch):
    """budget_iters=0 with start='floor': the one candidate is the floor, which goes through the final checks
    (re-time against the A/A, samples, sanitizer) and into the store: how a verified floor reaches users."""
    factory, root = toy
    floor = (1, 0, 2, 3, 4, 5, 7, 6)
    monkeypatch.setattr(tuning, "engine_initial", lambda cubin, moves: ToyEngine.perm(cubin))
    monkeypatch.setattr(tuning, "engine_floor", lambda cubin: ToyEngine.cubin(floor))
    config = tuning.TuneConfig(budget_iters=0, runs=1, samples=500, seed=4, moves="control", start="floor")
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert report.iterations == 0 and FakeRunner.instances[0].evaluated == [floor]
    entry = tuned.lookup(root, "toy", factory().kernel.variant, factory().kernel.cubin)
    assert entry is not None and entry.tuned == ToyEngine.cubin(floor) and report.speedup > 1
    assert entry.meta["start"]["over_start"] == pytest.approx(1.0)


def test_no_iteration_needs_a_floor_start_and_says_when_the_floor_is_the_original(toy, monkeypatch):
    factory, root = toy
    with pytest.raises(ValueError, match="only a floor start"):
        tuning.TuneConfig(budget_iters=0, moves="control")
    monkeypatch.setattr(tuning, "engine_initial", lambda cubin, moves: ToyEngine.perm(cubin))
    monkeypatch.setattr(tuning, "engine_floor", lambda cubin: cubin)  # nothing to lower
    config = tuning.TuneConfig(budget_iters=0, runs=1, samples=500, seed=4, moves="control", start="floor")
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert report.outcome.startswith("the floor is the original") and not report.cached


@pytest.mark.parametrize("moves", ["global", "alu", "shared"])
def test_a_floor_start_needs_moves_that_edit_stall_counts(moves):
    with pytest.raises(ValueError, match="control"):
        tuning.TuneConfig(budget_iters=10, moves=moves, start="floor")
    tuning.TuneConfig(budget_iters=10, moves=moves + ",control", start="floor")
    with pytest.raises(ValueError, match="start must be one of"):
        tuning.TuneConfig(budget_iters=10, moves=moves, start="last")


def test_the_op_level_speedup_is_stored_and_a_finalist_that_does_not_hold_there_is_passed_over(toy, monkeypatch):
    """With the tuned shape given, each finalist that passes validation and the sanitizer is re-timed
    through the public op (faked here): the first holds only 1.002x there (inside its A/A spread of
    0.004) and is passed over; the next, 1.15x there, is stored with that speedup and its checks."""
    factory, root = toy
    calls = []

    def retime(kernel, shape, candidate, store_root=None, **kw):
        calls.append((kernel, shape, candidate, store_root))
        speedup = 1.002 if len(calls) == 1 else 1.15
        return oplevel.OpTiming(kernel, "rosekernels.toy", dataclasses.asdict(shape), "cubin", "Fake H200",
                                heuristic_us=2.0, tuned_us=2.0 / speedup, speedup=speedup, aa_spread=0.004, rounds=60)

    monkeypatch.setattr(tuning.oplevel, "retime", retime)
    config = tuning.TuneConfig(budget_iters=3000, runs=2, seed=4, exhausted_after=10**6)
    report = tuning.tune(factory, config, shape=ToyShape(8), store_root=root, log=lambda m: None)
    kernel = factory().kernel
    assert len(calls) == 2 and all(c[0] == "toy" and c[1] == ToyShape(8) and c[3] == root for c in calls)
    assert all(c[2].variant == kernel.variant and c[2].original == kernel.cubin for c in calls)
    first, second = (ToyEngine.perm(c[2].tuned) for c in calls)
    assert first != second and "1.0020x" in report.finalists[1]["validation"] and "not past the bar" in \
        report.finalists[1]["validation"]
    assert report.speedup == 1.15 and report.op_level["speedup"] == 1.15 and "(the public op" in report.text()
    entry = tuned.lookup(root, "toy", kernel.variant, kernel.cubin)
    assert ToyEngine.perm(entry.tuned) == second and entry.speedup == 1.15
    assert entry.meta["worker_speedup"] == pytest.approx(1 / report.finalists[2]["rel"])
    checks = entry.meta["checks"]
    assert checks["samples"] == {"run": 10_000, "passed": 10_000} and checks["compare"] == "bitwise"
    assert checks["shapes"]["tuned"] == {"n": 8} and checks["shapes"]["tuned_samples"] == config.shape_samples
    assert checks["sanitizer"] == dict.fromkeys(tuning.probe.SANITIZER_TOOLS, "clean")
    assert entry.problems == []  # meets the store's bar
    # With a tolerance, the entry records it and stays below the bar (stored, not loaded by default).
    calls.clear()
    loose = tuning.tune(factory, dataclasses.replace(config, tolerance=(1e-2, 0.0)), shape=ToyShape(8),
                        store_root=root / "loose", log=lambda m: None)
    entry = tuned.lookup(root / "loose", "toy", kernel.variant, kernel.cubin)
    assert entry.meta["checks"]["tolerance"] == {"rtol": 1e-2, "atol": 0.0}
    assert entry.problems == ["compared at rtol=0.01, atol=0.0, not bitwise or at the kernel's own tolerance"]
    assert "below the store's bar" in loose.outcome
    # Without a shape there is no op-level re-time: the entry says so and is below the bar.
    plain = tuning.tune(factory, config, store_root=root / "plain", log=lambda m: None)
    entry = tuned.lookup(root / "plain", "toy", kernel.variant, kernel.cubin)
    assert plain.cached and entry.meta["checks"]["op_level"] == "not run (no shape given)"
    assert any(p.startswith("no op-level re-time") for p in entry.problems)


@dataclasses.dataclass(frozen=True)
class ToyShape:
    n: int



def test_a_search_resumes_from_the_fastest_stored_entry_that_meets_the_bar(toy, monkeypatch):
    """start='stored': the runs start at the tuned cubin of the entry a first tune stored (op level faked,
    so it meets the bar), and only a finalist faster than that start past the A/A spread goes to the checks:
    with no move to make, the start is the one finalist and nothing is stored again. Where no entry meets
    the bar (one stored without a shape has no op-level re-time), the runs start at the floor, or at the
    original when the moves do not edit stall counts."""
    factory, root = toy
    kernel = factory().kernel
    monkeypatch.setattr(tuning, "engine_initial", lambda cubin, moves=None: ToyEngine.perm(cubin))

    def retime(kernel_name, shape, candidate, store_root=None, **kw):
        speedup = 1 / ToyEngine.rel(ToyEngine.perm(candidate.tuned))
        return oplevel.OpTiming(kernel_name, "rosekernels.toy", dataclasses.asdict(shape), "cubin", "Fake H200",
                                heuristic_us=2.0, tuned_us=2.0 / speedup, speedup=speedup, aa_spread=0.001, rounds=60)

    monkeypatch.setattr(tuning.oplevel, "retime", retime)
    config = tuning.TuneConfig(budget_iters=3000, runs=2, seed=4, exhausted_after=10**6)
    first = tuning.tune(factory, config, shape=ToyShape(8), store_root=root, log=lambda m: None)
    entry = tuned.lookup(root, "toy", kernel.variant, kernel.cubin)
    assert first.cached and entry.problems == []
    assert tuning.stored_start(root, "toy", kernel.variant, kernel.cubin).tuned == entry.tuned
    tuning.tune(factory, config, store_root=root / "plain", log=lambda m: None)  # no shape: below the bar
    assert tuned.lookup(root / "plain", "toy", kernel.variant, kernel.cubin).problems
    assert tuning.stored_start(root / "plain", "toy", kernel.variant, kernel.cubin) is None

    FakeRunner.instances = []
    walked_from = []  # the schedules the walks propose moves from: the stored entry's
    monkeypatch.setattr(tuning, "engine_neighbour", lambda s, rng: walked_from.append(s) and None)
    resumed = tuning.tune(factory, dataclasses.replace(config, budget_iters=50, start="stored"), shape=ToyShape(8),
                          store_root=root, log=lambda m: None)
    assert FakeRunner.instances[0].evaluated[0] == ToyEngine.perm(entry.tuned)
    assert walked_from and set(walked_from) == {ToyEngine.perm(entry.tuned)}
    assert "the stored entry it started from stays" in resumed.outcome
    # with ncu weights, the stored cubin is profiled (its instructions may have moved), not the original
    profiled = []
    monkeypatch.setattr(tuning.probe, "profile", lambda factory, cubin: profiled.append(cubin) or "listing")
    monkeypatch.setattr(tuning, "engine_weighted", lambda schedule, listing: (schedule, []))
    tuning.tune(factory, dataclasses.replace(config, budget_iters=5, start="stored", hot="ncu"), shape=ToyShape(8),
                store_root=root, log=lambda m: None)
    assert profiled == [entry.tuned]
    assert resumed.start_from == str(entry.path) and resumed.start_sha256 == tuning._digest(entry.tuned)
    assert [f["digest"] for f in resumed.finalists] == [resumed.start_sha256]
    assert resumed.finalists[0]["validation"].startswith("skipped: 1.0000x the stored entry")
    assert not resumed.cached and tuned.lookup(root, "toy", kernel.variant, kernel.cubin).meta == entry.meta

    # a finalist past the start is checked on at least the samples the start passed, and its entry says
    # where it started from
    monkeypatch.setattr(tuning, "engine_neighbour", swap_neighbour_8)
    validated = []
    validate = FakeRunner.validate
    monkeypatch.setattr(FakeRunner, "validate", lambda self, cubin, seed, samples, shape_samples=0: (
        validated.append(samples) or validate(self, cubin, seed, samples, shape_samples)))
    weak = tuning.tune(factory, dataclasses.replace(config, budget_iters=20, seed=9, samples=20_000), shape=ToyShape(8),
                       store_root=root / "weak", log=lambda m: None)
    assert weak.cached
    start = tuned.lookup(root / "weak", "toy", kernel.variant, kernel.cubin)
    validated.clear()
    better = tuning.tune(factory, dataclasses.replace(config, start="stored"), shape=ToyShape(8),
                         store_root=root / "weak", log=lambda m: None)
    now = tuned.lookup(root / "weak", "toy", kernel.variant, kernel.cubin)
    assert better.cached and now.tuned != start.tuned and validated and min(validated) >= 20_000
    assert now.meta["start"]["from"] == str(start.path) and now.meta["start"]["sha256"] == tuned.sha256(start.tuned)

    floor = (1, 0, 2, 3, 4, 5, 7, 6)
    monkeypatch.setattr(tuning, "engine_floor", lambda cubin: ToyEngine.cubin(floor))
    for moves, start in (("control", ToyEngine.cubin(floor)), (None, kernel.cubin)):
        report = tuning.tune(factory, dataclasses.replace(config, budget_iters=50, start="stored", moves=moves),
                             store_root=root / "plain", log=lambda m: None)
        assert report.start_sha256 == tuning._digest(start)
        assert report.start_from == ("floor" if moves else "original")

def test_with_more_gpus_the_runs_go_to_one_worker_per_gpu_at_once(toy, monkeypatch):
    factory, root = toy
    monkeypatch.setattr(tuning, "_gpu_count", lambda: 2)
    config = tuning.TuneConfig(budget_iters=2000, runs=4, samples=50, seed=4, finalists=4, exhausted_after=10**6)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    searchers = FakeRunner.instances[:2]
    assert report.gpus == 2 and [r.device for r in searchers] == [0, 1]
    assert all(r.evaluated for r in searchers)  # both searched (runs 0, 2 on GPU 0; 1, 3 on GPU 1)
    assert [r["seed"] for r in report.runs] == [4, 5, 6, 7] and report.iterations == 2000
    ran = searchers[0].evaluated + searchers[1].evaluated
    assert report.evaluated == len(ran) == len(set(ran))  # one memo: no cubin ran on both GPUs
    assert report.cached and report.speedup > 1.2 and "on 2 GPUs" in report.text()


def test_tune_is_reproducible_by_seed(toy):
    factory, root = toy
    config = tuning.TuneConfig(budget_iters=300, runs=2, samples=10, seed=9)
    a = tuning.tune(factory, config, store_root=root / "a", log=lambda m: None)
    b = tuning.tune(factory, config, store_root=root / "b", log=lambda m: None)
    assert FakeRunner.instances[0].evaluated == FakeRunner.instances[1].evaluated
    assert [r["best_rel"] for r in a.runs] == [r["best_rel"] for r in b.runs]
    c = tuning.tune(factory, tuning.TuneConfig(budget_iters=300, runs=2, samples=10, seed=10),
                    store_root=root / "c", log=lambda m: None)
    assert FakeRunner.instances[2].evaluated != FakeRunner.instances[0].evaluated
    assert c.iterations == 300


def test_tune_caches_nothing_below_the_required_speedup(toy):
    factory, root = toy
    report = tuning.tune(factory, tuning.TuneConfig(budget_iters=200, runs=1, samples=10, min_speedup=2.0),
                         store_root=root, log=lambda m: None)
    assert not report.cached and "nothing cached" in report.outcome
    assert all(f["validation"].startswith("skipped") for f in report.finalists)
    assert tuned.list_entries(root) == []


def test_a_finalist_compute_sanitizer_flags_is_not_stored(toy, monkeypatch):
    factory, root = toy
    checked = []

    def sanitize(f, cubin, tools=tuning.probe.SANITIZER_TOOLS):
        verdicts = dict.fromkeys(tools, "clean")
        if cubin is None:  # the original, checked once a finalist is flagged
            return verdicts
        checked.append(ToyEngine.perm(cubin))
        if len(checked) == 1:  # the first finalist that passes validation races
            verdicts["racecheck"] = "exit 99: ========= Error: Race reported between Write access ..."
        return verdicts

    monkeypatch.setattr(tuning.probe, "sanitize", sanitize)
    config = tuning.TuneConfig(budget_iters=3000, runs=2, samples=50, seed=4, exhausted_after=10**6)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert len(checked) == 2 and report.cached
    entry = tuned.lookup(root, "toy", factory().kernel.variant, factory().kernel.cubin)
    assert ToyEngine.perm(entry.tuned) == checked[1] != checked[0]
    assert entry.meta["sanitizer"] == dict.fromkeys(tuning.probe.SANITIZER_TOOLS, "clean")
    assert sum("racecheck exit 99" in f.get("validation", "") for f in report.finalists) == 1
    # without the check nothing is run and the entry says so
    monkeypatch.setattr(tuning.probe, "sanitize", lambda f, c: pytest.fail("sanitizer ran"))
    report = tuning.tune(factory, dataclasses.replace(config, sanitize=False), store_root=root / "unchecked",
                         log=lambda m: None)
    entry = tuned.lookup(root / "unchecked", "toy", factory().kernel.variant, factory().kernel.cubin)
    assert report.cached and entry.meta["sanitizer"] == "not run"


def test_when_the_original_fails_the_sanitizer_too_no_finalist_is_blamed(toy, monkeypatch):
    factory, root = toy
    calls = []

    def sanitize(f, cubin, tools=tuning.probe.SANITIZER_TOOLS):
        calls.append((cubin is None, tools))
        return dict.fromkeys(tools, "exit 99: ========= Invalid __global__ read of size 4")

    monkeypatch.setattr(tuning.probe, "sanitize", sanitize)
    config = tuning.TuneConfig(budget_iters=3000, runs=2, samples=50, seed=4, exhausted_after=10**6)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert calls == [(False, tuning.probe.SANITIZER_TOOLS), (True, tuning.probe.SANITIZER_TOOLS)]
    assert "does not pass the original kernel either" in report.outcome and not report.cached
    assert tuned.list_entries(root) == []


def test_proposals_can_follow_the_profilers_samples(toy, monkeypatch):
    """hot="ncu": the original is profiled once (after the CPU-side checks) and its listing weights
    the engine's proposals."""
    factory, root = toy
    seen = []

    def weighted(schedule, listing):
        seen.append((schedule, listing))
        return schedule, [{"offset": 0x1a0, "share": 0.83, "instructions": 40, "loop_depth": 1}]

    monkeypatch.setattr(tuning.probe, "profile", lambda f, cubin: f"listing of {len(cubin)} bytes")
    monkeypatch.setattr(tuning, "engine_weighted", weighted)
    config = tuning.TuneConfig(budget_iters=50, runs=1, samples=10, hot="ncu")
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert seen == [(ToyEngine.perm(factory().kernel.cubin), f"listing of {len(factory().kernel.cubin)} bytes")]
    assert report.hot_blocks[0]["share"] == 0.83 and "0x01a0 (40 instructions, loop depth 1): 83%" in report.text()
    with pytest.raises(ValueError, match="hot must be one of"):
        tuning.TuneConfig(budget_iters=1, hot="nsys")
    monkeypatch.setattr(tuning, "engine_stats", lambda s: (8, 0, 0))  # nothing to tune: nothing profiled
    seen.clear()
    assert "no legal move" in tuning.tune(factory, config, store_root=root, log=lambda m: None).outcome and not seen


def test_without_compute_sanitizer_tuning_refuses_before_the_search(toy, monkeypatch):
    factory, root = toy
    monkeypatch.setattr(tuning.probe, "sanitizer_problem", lambda: "compute-sanitizer not found on PATH")
    with pytest.raises(tuning.probe.ProbeError, match="not found on PATH.*--no-sanitize"):
        tuning.tune(factory, tuning.TuneConfig(budget_iters=50), store_root=root, log=lambda m: None)
    assert not FakeRunner.instances
    report = tuning.tune(factory, tuning.TuneConfig(budget_iters=50, samples=10, sanitize=False), store_root=root,
                         log=lambda m: None)
    assert report.iterations == 50


def test_the_engine_weights_a_real_kernel_by_a_listing(corpus):
    """engine_weighted on a corpus cubin: the listing's hot block gets the proposals' weight."""
    from sip_corpus import corpus_entry, ncu_listing

    cubin = corpus_entry(corpus, "smem_tiled_gemm")
    schedule = tuning.engine_initial(cubin, "alu")
    k = schedule.model.kernel
    hot = max(range(len(k.blocks)), key=lambda b: len(k.blocks[b]))
    counts = [100 if k.block_of[i] == hot else 0 for i in range(len(k.instructions))]
    weighted, top = tuning.engine_weighted(schedule, ncu_listing(k, counts))
    assert top[0]["share"] == 1.0 and top[0]["offset"] == k.instructions[k.blocks[hot].start].offset
    assert weighted.layout.moves == schedule.layout.moves and weighted.layout.weight != schedule.layout.weight
    assert min(w for i, w in enumerate(weighted.layout.weight) if k.block_of[i] == hot) > 50 * max(
        w for i, w in enumerate(weighted.layout.weight) if k.block_of[i] != hot)


class NoisyRunner(FakeRunner):
    """Times the byte-identical copy of the original (the A/A pair) 1.4x off: a noise floor no toy
    schedule beats."""

    def compare(self, cubins, reps):
        timing = super().compare(cubins, reps)
        assert ToyEngine.perm(cubins[0]) == tuple(reversed(range(8)))  # the copy goes first
        timing["rel"][1] = 1.4
        return timing


def test_a_finalist_must_beat_the_a_a_spread(toy, monkeypatch):
    factory, root = toy
    monkeypatch.setattr(tuning, "Runner", NoisyRunner)
    config = tuning.TuneConfig(budget_iters=300, runs=1, samples=10, retimes=3)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    assert report.aa_spread == pytest.approx(0.4) and report.bar == pytest.approx(1.4)
    assert max(1 / f["rel"] for f in report.finalists) > 1.01  # would have passed min_speedup alone
    assert all("bar 1.4000x" in f["validation"] for f in report.finalists) and not report.cached
    assert all(len(f["rels"]) == 3 for f in report.finalists)
    assert NoisyRunner.instances[-1].starts == 1 + 3  # the search's worker, then one per re-time
    assert "A/A" in report.text() and tuned.list_entries(root) == []


@pytest.mark.parametrize("moves, samples, expected", [(None, 0, 10_000), ("global", 0, 10_000),
                                                      ("global,alu", 0, 100_000), ("all", 0, 100_000),
                                                      ("all", 7, 7)])
def test_new_move_classes_validate_on_more_samples_by_default(moves, samples, expected):
    config = tuning.TuneConfig(budget_iters=1, moves=moves, samples=samples)
    assert config.validation_samples == expected


# ---------------------------------------------------------------------------------------------
# The worker process on the CPU: a stand-in for the GPU bench that can crash.

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
    with pytest.raises(WorkerFailure, match="could not set up the kernel.*no such kernel"):
        with Runner(broken_workload, bench=CpuBench) as runner:
            runner.start()


def test_a_run_ends_early_once_nothing_new_is_proposed(toy):
    factory, root = toy
    config = tuning.TuneConfig(budget_iters=20000, runs=1, samples=10, t_min=1e-6, exhausted_after=40)
    report = tuning.tune(factory, config, store_root=root, log=lambda m: None)
    (run,) = report.runs
    assert run["exhausted"] and run["iterations"] < 20000 and "ended early" in report.text()


def test_a_kernel_without_legal_moves_is_not_searched(toy, monkeypatch):
    factory, root = toy
    monkeypatch.setattr(tuning, "engine_stats", lambda s: (8, 0, 0))
    report = tuning.tune(factory, tuning.TuneConfig(budget_iters=100), store_root=root, log=lambda m: None)
    assert "no legal move" in report.outcome and report.iterations == 0 and not FakeRunner.instances


def test_tune_config_needs_exactly_one_budget():
    with pytest.raises(ValueError, match="exactly one budget"):
        tuning.TuneConfig()
    with pytest.raises(ValueError, match="exactly one budget"):
        tuning.TuneConfig(budget_iters=5, budget_seconds=5.0)
    split = tuning.TuneConfig(budget_iters=100, runs=4).anneal()
    assert split.max_iters == 25 and split.max_seconds is None


def test_input_set_bytes_count_device_tensors_only():
    """The ring of input sets is sized by the bytes that pass through L2: a workload's host-side
    reference tensors (append_kvcache keeps its expected caches there) count for nothing."""
    import torch

    assert _set_bytes((torch.zeros(1000), 3, torch.zeros(5, dtype=torch.int32))) == 1


def test_a_cubin_that_leaves_its_counter_set_is_refused():
    """Level 2's test (_Bench._test, CPU tensors): the candidate must also return the counter it
    found zero to zero, or the op's next launch on the same counter would skip its work."""
    import math
    from types import SimpleNamespace

    import torch

    from sip_tune.runner import SCRATCH_LEFT, Options, _Bench
    from rosekernels.workload import Workload

    def make_args(seed):
        x = torch.randn(1 + seed % 40, generator=torch.Generator().manual_seed(seed))
        return x, torch.full_like(x, math.nan), torch.zeros(1, dtype=torch.int32)

    def kernel(rezero):
        def fn(x, y, counter):
            if int(counter) == 0:  # a claim: a launch that finds the counter set does nothing
                torch.add(x, 1, out=y)
            counter += 1
            if rezero:
                counter.zero_()
        return fn

    bench = _Bench.__new__(_Bench)
    bench.torch, bench.o, bench.base = torch, Options(), kernel(rezero=True)
    bench.w = Workload(SimpleNamespace(fn=bench.base), make_args, outputs=lambda a: a[1:2])
    kept = bench._test(kernel(rezero=True), 3, 10, batch=4)
    assert not kept["failed"] and kept["passed"] == 10
    left = bench._test(kernel(rezero=False), 3, 10, batch=4)
    assert left["failed"] and left["passed"] == 0 and left["detail"] == f"sample 0: {SCRATCH_LEFT}"


@pytest.mark.parametrize("moves", ["control", "all", "all,scoreboard,sync"])
def test_the_tuners_floor_start_is_sip_floors_cubin(corpus, moves, tmp_path):
    """sip-tune --start floor anneals from the very cubin `sip floor` writes (the one bench/sip_compute.py
    timed), lowered under the trusted dependency model whatever classes the run may use besides (a
    relaxed model would lower further, to a schedule nobody timed), and read back under those classes."""
    data = corpus_entry(corpus, "rosekernels_tma_wgmma_gemm")
    src, out = tmp_path / "in.cubin", tmp_path / "out.cubin"
    src.write_bytes(data)
    assert sip_cli.main(["floor", str(src), "-o", str(out)]) == 0
    start = tuning.engine_floor(data)
    assert start == out.read_bytes() != data
    assert tuning.engine_apply(tuning.engine_initial(start, moves)) == start
