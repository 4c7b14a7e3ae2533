"""bench/sip_compute.py on the CPU: the order of the campaign's steps, its budgets, the extension of the
most promising cells, resuming across calls that run out of time, failures, the op-level call site and
its adapter (a stand-in sip_tune.oplevel), and the results table (GPU columns marked not run)."""
import dataclasses
import hashlib
import json
import math
import sys
import time
import types
from pathlib import Path

import pytest
from sip_corpus import corpus  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the benchmark scripts import report as a top-level module

import sip_compute as C  # noqa: E402

from sip_tune import compute  # noqa: E402

KERNELS = ("k_varlen", "k_dense", "k_gemm")
CLASSES = ("alu", "global")


def fresh_state(legal=None):
    """A static state: three kernels x two classes; `legal` {cell key: legal moves} (default 5)."""
    legal = legal or {}
    loops = [{"offset": 0x4860, "depth": 2, "instructions": 450, "stall_cycles": 1033, "opcodes": {}}]
    floor = [dict(loops[0], stall_cycles=735)]
    state = {"kernels": {k: {"about": k, "variant": k, "cubin_sha256": "0" * 64, "loops": loops, "floor_loops": floor}
                         for k in KERNELS},
             "cells": {}}
    for k in KERNELS:
        for m in CLASSES:
            key = C.cell_key(k, m)
            state["cells"][key] = {"kernel": k, "moves": m, "runs": [],
                                   "static": {"instructions": 100, "movable": 7, "legal_moves": legal.get(key, 5)}}
    return state


def a_run(seconds=C.BASE_SECONDS, evaluated=100, best=1.0, aa=0.004, cached="", exhausted=False):
    return {"seed": 1, "search_seconds": seconds, "total_seconds": seconds + 60, "iterations": evaluated,
            "evaluated": evaluated, "incorrect": 0, "crashed": 0, "exhausted": exhausted, "best_speedup": best,
            "aa_spread": aa, "cached": cached, "outcome": "", "bar": 1 + aa, "speedup": 1.0}


def do(state, step, margins):
    """Play a step the way the GPU would: a profile, a base or extended search run, a judge part."""
    what, key = step
    if what == "profile":
        state.setdefault("profiles", {})[key] = {"samples": 1000, "hot_blocks": [], "headroom": 0.1, "sensitive": 0.05,
                                                  "stalls": {}}
    elif what == "floor":
        state.setdefault("floors", {})[key] = {"speedup": 0.999, "aa_spread": 0.002, "runs": [], "validation": "ok",
                                               "floor_sha256": "f" * 64}
    elif what == "search":
        cell = state["cells"][key]
        best = margins.get(key, 0.0) + 1.004
        stored = f"/store/{key}" if best > 1.01 else ""
        cell["runs"].append(a_run(seconds=C.budget(cell) - C.searched(cell)[0], best=best, cached=stored))
    else:
        state["cells"][key].setdefault("judge", {})[what] = {"done": True}


def test_the_steps_go_kernel_by_kernel_then_extend_the_promising_then_judge():
    state = fresh_state({C.cell_key("k_dense", "global"): 0})
    margins = {C.cell_key("k_varlen", "alu"): 0.03, C.cell_key("k_gemm", "alu"): 0.02,
               C.cell_key("k_dense", "alu"): 0.001}
    steps = []
    while (step := C.next_step(state, list(KERNELS))) is not None:
        steps.append(step)
        do(state, step, margins)
        assert len(steps) < 100
    assert steps[:6] == [(what, k) for k in KERNELS for what in ("profile", "floor")]  # where the cycles go, first
    assert steps[6:8] == [("search", C.cell_key("k_varlen", "alu")), ("search", C.cell_key("k_varlen", "global"))]
    assert ("search", C.cell_key("k_dense", "global")) not in steps  # no legal move: never sent to the GPU
    # base searches: one run each (the whole base budget); then the two best margins get extended
    extended = [k for k, c in state["cells"].items() if C.budget(c) == C.EXTENDED_SECONDS]
    assert sorted(extended) == sorted([C.cell_key("k_varlen", "alu"), C.cell_key("k_gemm", "alu")])
    for key in extended:
        assert C.searched(state["cells"][key])[0] == C.EXTENDED_SECONDS and len(state["cells"][key]["runs"]) == 2
    first_judge = next(k for k, s in enumerate(steps) if s[0] in C.JUDGE_SECONDS)
    assert all(s[0] in C.JUDGE_SECONDS for s in steps[first_judge:])  # judging only after every search
    judged = {key for what, key in steps if what in C.JUDGE_SECONDS}
    assert judged == {C.cell_key("k_varlen", "alu"), C.cell_key("k_gemm", "alu")}  # only cells with a winner
    assert sum(s[0] == "sanitizer" for s in steps) == len(judged)
    assert {r["status"] for r in C.rows(state)} == {
        "judged", "no legal move: nothing to search", "searched: no finalist past 1 + A/A and 100000 samples",
        "searched: no finalist past 1 + A/A and 10000 samples"}  # global validates on 10^4, the rest on 10^5


def test_kernels_under_the_minimum_headroom_are_profiled_but_not_searched():
    state = fresh_state()
    state["meta"] = {"min_headroom": 0.05}
    steps = []
    while (step := C.next_step(state, list(KERNELS))) is not None:
        steps.append(step)
        do(state, step, {})
        if step == ("profile", "k_dense"):
            state["profiles"]["k_dense"]["headroom"] = 0.01  # measured: under the minimum
    assert ("profile", "k_dense") in steps and ("floor", "k_dense") in steps
    assert not [s for s in steps if s[0] == "search" and s[1].startswith("k_dense")]
    assert {r["status"] for r in C.rows(state) if r["kernel"] == "k_dense"} == {
        "skipped: samples outside issue cycles 1.00% < 5.00%"}
    assert all(C.search_done(c) for c in state["cells"].values() if c["kernel"] != "k_dense")


def test_a_cell_is_searched_until_its_time_its_candidates_or_its_space_runs_out():
    state = fresh_state()
    cell = state["cells"][C.cell_key("k_varlen", "alu")]
    assert not C.search_done(cell)
    cell["runs"].append(a_run(seconds=200, evaluated=3000))
    assert not C.search_done(cell) and C.searched(cell) == (200, 3000, False)
    cell["runs"].append(a_run(seconds=50, evaluated=7000))  # 10^4 cubins: done before 5 minutes
    assert C.search_done(cell)
    other = state["cells"][C.cell_key("k_dense", "alu")]
    other["runs"].append(a_run(seconds=20, evaluated=90, exhausted=True))  # nothing new nearby: done
    assert C.search_done(other)
    extended = state["cells"][C.cell_key("k_gemm", "alu")]
    extended["budget_seconds"] = C.EXTENDED_SECONDS
    extended["runs"].append(a_run(seconds=600, evaluated=20_000))  # extended cells count time only
    assert not C.search_done(extended)
    extended["runs"].append(a_run(seconds=600, evaluated=20_000))
    assert C.search_done(extended)


def test_three_failed_runs_in_a_row_end_a_cell_and_failures_are_recorded():
    state = fresh_state()
    key = C.cell_key("k_varlen", "alu")
    for k in range(3):
        assert not C.search_done(state["cells"][key])
        C.record_failure(state, "search", key, f"WorkerFailure: boom {k}")
    assert C.search_done(state["cells"][key])
    assert [r["error"] for r in state["cells"][key]["runs"]] == [f"WorkerFailure: boom {k}" for k in range(3)]
    C.record_failure(state, "profile", "k_dense", "ProbeError: no ncu")
    assert state["profiles"]["k_dense"]["error"] == "ProbeError: no ncu"
    C.record_failure(state, "op_level", key, "x")
    assert state["cells"][key]["judge"]["op_level"] == {"error": "x"}
    assert "error: x" in C.markdown(state)


def test_calls_that_run_out_of_time_resume_where_they_stopped(tmp_path, monkeypatch):
    """Each call does what fits before its deadline (a fake clock the fake steps advance), saves the
    state after every step, and the next call, from the file, does only what is left."""
    clock = [0.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(C.report, "environment", lambda: {"gpu": "FakeGPU", "toolchain": "t"})
    monkeypatch.setattr(C, "static_state", lambda cells, classes: fresh_state())
    done = []

    def fake(what, cost):
        def step(state, key, *args, **kwargs):
            done.append((what, key))
            clock[0] += cost
            if what == "search":
                cell = state["cells"][key]
                cell["runs"].append(a_run(seconds=min(args[1], C.budget(cell) - C.searched(cell)[0]),
                                          best=1.02 if "varlen" in key else 1.0,
                                          cached=f"/s/{key}" if "varlen" in key else ""))
            else:
                do(state, (what, key), {})
        return step

    monkeypatch.setattr(C, "run_profile", fake("profile", 100))
    monkeypatch.setattr(C, "run_floor", fake("floor", 100))
    monkeypatch.setattr(C, "run_search", fake("search", C.BASE_SECONDS + 100))
    monkeypatch.setattr(C, "run_judge", lambda state, part, key, cell: (
        done.append((part, key)), state["cells"][key].setdefault("judge", {}).__setitem__(part, {"ok": 1}),
        clock.__setitem__(0, clock[0] + 60)))
    cells = {k: compute.Cell(k, None, k, None, k) for k in KERNELS}
    calls = 0
    while True:
        calls += 1
        before = len(done)
        C.campaign(tmp_path, clock[0] + 8.5 * 60, cells, CLASSES, log=lambda m: None)
        state = json.loads((tmp_path / "state.json").read_text())
        if C.next_step(state, list(KERNELS)) is None:
            break
        assert len(done) > before, "a call made no progress"
        assert calls < 40
    assert calls > 3  # the deadline cut the campaign into several calls
    assert all(what == "search" for what, _ in {s for s in done if done.count(s) > 1})  # only searches go on
    assert [w for w, _ in done].count("profile") == [w for w, _ in done].count("floor") == len(KERNELS)
    assert state["meta"]["gpu"] == "FakeGPU"
    assert all(state["cells"][C.cell_key("k_varlen", m)]["judge"].keys() == C.JUDGE_SECONDS.keys() for m in CLASSES)


def test_the_op_level_call_site_and_its_adapter(monkeypatch):
    """The one call into sip_tune.oplevel (a stand-in module here): what it is given, and what the
    campaign keeps of the OpTiming it returns."""

    @dataclasses.dataclass
    class Timing:  # the fields of sip_tune.oplevel.OpTiming the adapter reads
        speedup: float = 1.031
        aa_spread: float = 0.004
        peer: str = "fa4"
        vs_peer: float = 1.07
        op: str = "rosekernels.attention"
        heuristic_us: float = 100.0
        tuned_us: float = 97.0
        error: str = ""

    calls, stores = [], []

    def retime(kernel, shape, candidate, *, store_root):
        calls.append((kernel, shape, candidate))
        stores.append((store_root, list(Path(store_root).iterdir())))  # what the op's store holds then
        return Timing()

    fake = types.SimpleNamespace(CubinCandidate=lambda variant, original, tuned: ("cubin", variant, original, tuned),
                                 retime=retime)
    monkeypatch.setattr(C, "oplevel", fake)
    cell = compute.Cell("attention_d64", None, "attention", {"head_dim": 64}, "")
    got = C.op_level(cell, "variant-key", b"orig", b"tuned")
    assert calls == [("attention", {"head_dim": 64}, ("cubin", "variant-key", b"orig", b"tuned"))]
    # an empty store of the campaign's own, not the user's default one (None): no verified config entry of
    # the user's steers the op to another config than the tuned cubin's
    assert stores[0][0] is not None and stores[0][1] == [] and not Path(stores[0][0]).exists()
    assert got == {"speedup": 1.031, "aa_spread": 0.004, "past_aa": True, "peer": "fa4", "vs_peer": 1.07,
                   "op": "rosekernels.attention", "heuristic_us": 100.0, "tuned_us": 97.0}
    assert C.op_level_record(Timing(speedup=1.002, aa_spread=0.004))["past_aa"] is False
    assert C.op_level_record(Timing(error="no op-level case for 'x'")) == {"error": "no op-level case for 'x'"}


def test_every_cell_has_an_op_level_case():
    """Each kernel of the campaign can be judged through its public op: sip_tune.oplevel has a case for
    it, and the case's input sets are the shape's (built on the CPU here)."""
    from sip_tune import oplevel

    for cell in compute.cells().values():
        assert cell.op in oplevel.CASES and cell.shape is not None, cell.name
    case = oplevel.CASES[compute.VARLEN](oplevel.VarlenShape(64, False, (3, 5), heads=2))
    q, k, v, cu, out = case.make_set(0, "cpu")
    assert q.shape == k.shape == v.shape == out.shape == (8, 2, 64) and cu.tolist() == [0, 3, 8]
    assert case.op == "rosekernels.attention_varlen" and set(case.peers) == {"fa4"}


def test_each_dense_attention_cell_reaches_the_variant_the_op_launches_at_its_shape():
    """A cell's workload is the config the op itself launches at the cell's shape (else the entry it stores
    serves no call): d=128 at 2k keys and at 8k keys are two cubins, 128- and 192-key tiles."""
    from rosekernels.kernels import attention_plan
    from sip_tune import workloads

    cells = compute.cells()
    for name, tile_n in (("attention_d128", 128), ("attention_d128_long", 192), ("attention_d128_causal", 128)):
        built, _ = workloads.resolve(*cells[name].factory.args)
        assert built == attention_plan.config_for(cells[name].shape), name
        assert built.tile_n == tile_n, (name, built)


def test_run_record_keeps_the_best_finalist_and_the_a_over_a(tmp_path):
    (tmp_path / "tuned.cubin").write_bytes(b"tuned by this run")
    digest = hashlib.sha256(b"tuned by this run").hexdigest()
    report = types.SimpleNamespace(
        finalists=[{"rel": 0.99, "validation": "skipped", "digest": "a" * 64},
                   {"rel": 0.97, "validation": "ok: 100000 passed", "digest": digest}],
        search_seconds=280.0, total_seconds=400.0, iterations=3000, evaluated=2500, incorrect=3, crashed=1,
        runs=[{"exhausted": False}, {"exhausted": True}], aa_spread=0.005, bar=1.01, speedup=1.02,
        samples_passed=100000, cached=str(tmp_path), outcome="cached", gpu="H200", original_sha256="o" * 64,
        start_sha256="o" * 64, start_speedup=1.0)
    for f in report.finalists:
        f["over_start"] = 1 / f["rel"]
    r = C.run_record(report, seed=17)
    assert r["best_speedup"] == pytest.approx(1 / 0.97) and r["best_validation"] == "ok: 100000 passed"
    assert r["exhausted"] is False and r["evaluated"] == 2500 and r["cached"] == str(tmp_path)
    assert r["tuned_sha256"] == digest and r["kept_older"] is False and r["winner_is_start"] is False
    assert r["best_over_start"] == pytest.approx(1 / 0.97) and r["start_speedup"] == 1.0
    report.finalists = report.finalists[:1]  # the store kept an entry of an earlier run
    assert C.run_record(report, 1)["kept_older"] is True and C.run_record(report, 1)["tuned_sha256"] == digest
    report.finalists, report.cached = [], ""
    r = C.run_record(report, 1)
    assert math.isnan(r["best_speedup"]) and r["tuned_sha256"] == "" and r["kept_older"] is False


def test_the_table_marks_what_no_gpu_has_measured():
    state = fresh_state({C.cell_key("k_gemm", "global"): 0})
    state["meta"] = {"gpu": "no GPU run yet"}
    text = C.markdown(state)
    row = next(line for line in text.splitlines() if line.startswith("| k_varlen | `alu`"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[2:4] == ["7", "5"] and cols[4:12] == [C.NOT_RUN] * 8
    assert "no legal move: nothing to search" in text and "ncu: not run yet" in text
    assert "floor: loop 0x4860 1033 -> 735 stall cycles; timing not run" in text
    state["kernels"]["k_varlen"]["mainloop_pairs"] = {"offset": 0x4860, "instructions": 450, "pairs": 441, "trusted": {
        "free": 285, "scoreboard guard": 54, "fence WARPGROUP": 7}, "relaxed": {"free": 318, "scoreboard guard": 30}}
    assert ("mainloop 0x4860, 441 adjacent pairs, trusted -> relaxed (scoreboard, sync): free 285 -> 318, "
            "scoreboard guard 54 -> 30, fence WARPGROUP 7 -> 0") in C.markdown(state)
    state["kernels"]["k_varlen"]["floor_holds"] = {"latency pair": 415, "anchor": 136, "block start": 41,
                                                    "block end": 1, "pinned": 300, "above the floor": 0}
    assert ("at the floor, the loop blocks' stall cycles above one per instruction are held by: latency pair 415, "
            "anchor 136, block start 41, block end 1, pinned 300") in C.markdown(state)
    state["floors"] = {"k_varlen": {"speedup": 0.9987, "aa_spread": 0.0021, "validation": "ok: 10000 of 10000 samples"}}
    assert "loop 0x4860 1033 -> 735 stall cycles; re-timed 0.9987x (A/A 0.21%), ok: 10000 of 10000 samples" \
        in C.markdown(state)
    cell = state["cells"][C.cell_key("k_varlen", "alu")]
    cell["runs"].append(a_run(evaluated=4321, best=1.0123, aa=0.0031, cached="/s"))
    cell["judge"] = {"retime": {"speedup": 1.011, "aa_spread": 0.002, "runs": []},
                     "op_level": {"error": "not run: sip_tune.oplevel is not in this tree"},
                     "sanitizer": {"memcheck": "clean", "racecheck": "exit 99: hazard", "synccheck": "clean"}}
    state["profiles"] = {"k_varlen": {"samples": 5000, "headroom": 0.571, "sensitive": 0.071, "stalls": {},
                                      "hot_blocks": [
        {"offset": 0x4b80, "share": 0.41, "instructions": 388, "loop_depth": 2,
         "stalls": {"math": 300, "short_sb": 100, "selected": 100}}]}}
    text = C.markdown(state)
    row = next(line for line in text.splitlines() if line.startswith("| k_varlen | `alu`"))
    assert ("| 4321 | 300 | 1.0123x | from the original | 0.31% | 1.0110x (A/A 0.20%) | "
            "error: not run: sip_tune.oplevel") in row
    assert "memcheck clean, racecheck FAILED, synccheck clean | judged |" in row
    assert "5000 samples, 57.1% of them outside issue cycles, 7.1% schedule-sensitive" in text
    assert "block 0x4b80 (388 instructions, loop depth 2): 41% of the samples; math 60%, short_sb 20%, selected 20%" \
        in text


def test_floor_holds_share_out_the_loop_blocks_stall_cycles_at_the_floor(corpus):
    """On the package's GEMM: every stall cycle above one in its loop blocks at the floor is held by one of
    the kinds, none is left above the floor, and the latency pairs and pinned instructions hold some."""
    from sip import mutate
    from sip_corpus import corpus_entry

    held = C.floor_holds(corpus_entry(corpus, "rosekernels_tma_wgmma_gemm"))
    assert set(held) == set(mutate.HOLDS) and held["above the floor"] == 0
    assert held["latency pair"] > 0 and held["pinned"] > 0


def test_mainloop_pairs_count_every_adjacent_pair_of_the_wgmma_loop(corpus):
    """On the package's GEMM (corpus): the mainloop is the deepest loop issuing HGMMA, every adjacent
    pair of it gets one kind under each model, and the relaxations only free pairs."""
    from sip_corpus import corpus_entry

    pairs = C.mainloop_pairs(corpus_entry(corpus, "rosekernels_tma_wgmma_gemm"))
    assert pairs is not None and pairs["instructions"] >= 60
    for label in ("trusted", "relaxed"):
        assert sum(pairs[label].values()) == pairs["pairs"]
    assert pairs["relaxed"]["free"] >= pairs["trusted"]["free"] > 0
    assert pairs["trusted"].get("fence HGMMA", 0) > 0 and "fence WARPGROUP" not in pairs["relaxed"]
    assert C._reason_kind(None) == "free" and C._reason_kind("RAW on R1") == "registers"
    assert C._reason_kind("instruction 7 is pinned: control flow (BRA) never moves") == "fence BRA"


def fake_tune(cubins, stores):
    """A stand-in tune(): files `cubins[moves]` (or what the store holds, if it keeps an earlier entry
    of its own) as the entry of the kernel's one (variant, original) key under the store root it is
    given, as sip_tune.tuning does with keep_better."""

    def tune(factory, config, *, kernel, store_root):
        stores.append(store_root)
        entry = Path(store_root) / "toolchain" / kernel / "variant" / ("0" * 64)
        entry.mkdir(parents=True, exist_ok=True)
        ours = cubins[config.moves]
        if not (entry / "tuned.cubin").exists() or len(ours) > len((entry / "tuned.cubin").read_bytes()):
            (entry / "tuned.cubin").write_bytes(ours)  # "faster": longer, in this stand-in
        return types.SimpleNamespace(
            finalists=[{"rel": 0.97, "digest": hashlib.sha256(ours).hexdigest(), "validation": "ok",
                        "over_start": 1 / 0.97}],
            search_seconds=config.budget_seconds, total_seconds=config.budget_seconds, iterations=10, evaluated=10,
            incorrect=0, crashed=0, runs=[{"exhausted": False}], aa_spread=0.003, bar=1.01, speedup=1.03,
            samples_passed=100_000, cached=str(entry), outcome="cached", gpu="FakeGPU", original_sha256="o" * 64,
            start_sha256="o" * 64, start_speedup=1.0)
    return tune


def test_every_class_of_a_kernel_has_its_own_store_and_the_judge_judges_its_own_winner(tmp_path, monkeypatch):
    """The classes of one kernel share its variant and original cubin, which key a store entry: in one
    store the fastest class's cubin would be every class's winner. Each cell has a store of its own,
    the run records its entry's hash, and the judge refuses an entry that no longer holds it."""
    state = fresh_state()
    cubins = {"alu": b"alu's cubin", "global": b"global's longer cubin"}
    stores = []
    cell = compute.Cell("k_varlen", None, "k_varlen", None, "")
    for moves in CLASSES:
        C.run_search(state, C.cell_key("k_varlen", moves), cell, 60.0, tmp_path, tune=fake_tune(cubins, stores))
    assert len(set(stores)) == 2 and all(Path(s).is_relative_to(tmp_path / "store") for s in stores)
    judged = []
    monkeypatch.setattr(C, "retime_fresh", lambda factory, original, tuned: judged.append(tuned) or {"speedup": 1})
    cell = compute.Cell("k_varlen", lambda: types.SimpleNamespace(kernel=types.SimpleNamespace(cubin=b"original")),
                        "k_varlen", None, "")
    for moves in CLASSES:
        key = C.cell_key("k_varlen", moves)
        win = C.winner(state["cells"][key])
        assert win["tuned_sha256"] == hashlib.sha256(cubins[moves]).hexdigest() and not win["kept_older"]
        C.run_judge(state, "retime", key, cell)
    assert judged == [cubins["alu"], cubins["global"]]  # each class's own winner
    # A second alu run whose result the store does not keep: the record names the kept entry.
    C.run_search(state, C.cell_key("k_varlen", "alu"), cell, 60.0, tmp_path,
                 tune=fake_tune({"alu": b"short"}, stores))
    win = C.winner(state["cells"][C.cell_key("k_varlen", "alu")])
    assert win["kept_older"] and win["tuned_sha256"] == hashlib.sha256(cubins["alu"]).hexdigest()
    (Path(win["cached"]) / "tuned.cubin").write_bytes(b"another cubin")  # the entry changed behind the record
    with pytest.raises(RuntimeError, match="no longer holds the tuned cubin its run recorded"):
        C.run_judge(state, "retime", C.cell_key("k_varlen", "alu"), cell)


def test_a_call_on_some_kernels_and_classes_works_on_those_only(tmp_path, monkeypatch):
    """--kernels / --classes on a state of more cells: the steps of the others (k_dense's promising
    cell, to extend here) wait for a call that selects them, and the call writes its report."""
    state = fresh_state()
    for k in KERNELS:
        state.setdefault("profiles", {})[k] = {"samples": 1000, "hot_blocks": [], "headroom": 0.5, "sensitive": 0.2,
                                                "stalls": {}}
        state.setdefault("floors", {})[k] = {"speedup": 1.0, "aa_spread": 0.002, "floor_sha256": "f" * 64}
        for m in CLASSES:
            state["cells"][C.cell_key(k, m)]["runs"].append(a_run(best=1.0, exhausted=True))
    state["cells"][C.cell_key("k_dense", "alu")]["runs"] = [a_run(best=1.05, cached="/s/dense")]
    copy = lambda: json.loads(json.dumps(state))  # noqa: E731 - next_step extends cells in the state it is given
    assert C.next_step(copy(), list(KERNELS)) == ("search", C.cell_key("k_dense", "alu"))  # extended
    assert C.next_step(copy(), ["k_varlen", "k_gemm"]) is None
    assert C.next_step(copy(), list(KERNELS), ("global",)) is None
    state["cells"][C.cell_key("k_varlen", "global")]["runs"] = []
    assert C.next_step(copy(), ["k_varlen"], ("global",)) == ("search", C.cell_key("k_varlen", "global"))
    assert C.next_step(copy(), ["k_varlen"], ("alu",)) is None
    state["cells"][C.cell_key("k_varlen", "global")]["runs"] = [a_run(best=1.0, exhausted=True)]
    (tmp_path / "state.json").write_text(json.dumps(state))
    monkeypatch.setattr(C.report, "environment", lambda: {"gpu": "FakeGPU", "toolchain": "t"})
    only = {"k_varlen": compute.Cell("k_varlen", None, "k_varlen", None, "")}
    got = C.campaign(tmp_path, time.monotonic() + 600, only, CLASSES, log=lambda m: None)
    assert got["cells"] == state["cells"]  # nothing of the unselected kernels touched, nothing extended
    C.write(got, str(tmp_path / "out"))
    assert "| k_dense | `alu` |" in (tmp_path / "out" / "sip" / "sip_compute.md").read_text()
    with pytest.raises(SystemExit, match="no cells of the classes 'shared'"):
        C.campaign(tmp_path, time.monotonic() + 600, only, ("alu", "shared"), log=lambda m: None)


def _fake_campaign(monkeypatch, profile):
    """The campaign over KERNELS x CLASSES, every step a stand-in (profile: `profile`); the state starts
    static."""
    monkeypatch.setattr(C.report, "environment", lambda: {"gpu": "FakeGPU", "toolchain": "t"})
    monkeypatch.setattr(C, "static_state", lambda cells, classes: fresh_state())
    monkeypatch.setattr(C, "run_profile", profile)
    monkeypatch.setattr(C, "run_floor", lambda state, key, cell: do(state, ("floor", key), {}))
    return {k: compute.Cell(k, None, k, None, k) for k in KERNELS}


def test_a_step_is_marked_before_it_runs_and_recorded_failed_after_two_killed_calls(tmp_path, monkeypatch):
    """A call killed in a step (here: its profile of k_varlen, interrupted) records nothing of it but
    the try, written before the step began; the next call tries once more, and the one after records
    the step as failed and goes on, instead of retrying it forever."""
    tries = []

    def profile(state, key, cell):
        if key != "k_varlen":
            return do(state, ("profile", key), {})
        on_disk = json.loads((tmp_path / "state.json").read_text())
        tries.append(on_disk["attempts"]["profile k_varlen"])
        raise KeyboardInterrupt  # the lender ends the call

    cells = _fake_campaign(monkeypatch, profile)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            C.campaign(tmp_path, time.monotonic() + 600, cells, CLASSES, log=lambda m: None)
    assert tries == [1, 2]
    monkeypatch.setattr(C, "run_search", lambda *a, **k: None)  # the searches are not this test's
    monkeypatch.setattr(C, "step_seconds", lambda what: 1e9 if what == "search" else 0.0)
    state = C.campaign(tmp_path, time.monotonic() + 600, cells, CLASSES, log=lambda m: None)
    assert tries == [1, 2]  # not tried a third time
    assert "cut short 2 times" in state["profiles"]["k_varlen"]["error"]
    assert set(state["floors"]) == set(KERNELS) and set(state["profiles"]) == set(KERNELS)  # it went on
    assert state["attempts"] == {}


def _alive(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_step_past_the_time_left_is_stopped_with_its_processes_and_retried_then_failed(tmp_path, monkeypatch):
    """The step's limit is the time left in the call, whatever its tool allows (probe.sanitize 600 s
    per tool, ...): the profile here runs a process for a minute through sip_tune.probe.run_isolated
    (own session, as compute-sanitizer and ncu run); the limit stops the step and that process, the try
    stays counted, and a second overrun records the step as failed."""
    from sip_tune import probe

    pids = tmp_path / "pids"
    child = f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(60)"

    def profile(state, key, cell):
        probe.run_isolated([sys.executable, "-c", child], timeout_s=600)

    cells = _fake_campaign(monkeypatch, profile)
    monkeypatch.setattr(C, "SAVE_SECONDS", 1.0)
    monkeypatch.setattr(C, "PROFILE_SECONDS", 1.0)
    for call in (1, 2):
        t0 = time.monotonic()
        state = C.campaign(tmp_path, t0 + 5.0, cells, CLASSES, log=lambda m: None)
        assert time.monotonic() - t0 < 5.0  # stopped at the limit, with time left to write the state
        started = pids.read_text().split()
        assert len(started) == call and not any(_alive(int(pid)) for pid in started)  # its process went with it
        if call == 1:  # the first overrun: the try stays counted, the next call tries again
            assert "k_varlen" not in state.get("profiles", {}) and state["attempts"] == {"profile k_varlen": 1}
    # the second: recorded as failed at once, and written
    assert "cut short 2 times" in state["profiles"]["k_varlen"]["error"] and state["attempts"] == {}
    assert json.loads((tmp_path / "state.json").read_text())["profiles"]["k_varlen"] == state["profiles"]["k_varlen"]


def test_a_floor_that_pays_is_judged_before_the_searches_and_one_that_does_not_is_not():
    """A floor past FLOOR_BAR and its A/A with every sample passed is a schedule of its own: its op-level
    re-time and sanitizer come right after the profiles and floors. One under the bar, or one that
    failed a sample, is never judged."""
    state = fresh_state()
    floors = {"k_varlen": {"speedup": 1.022, "aa_spread": 0.0004, "validation": "ok: 10000 of 10000 samples"},
              "k_dense": {"speedup": 1.006, "aa_spread": 0.0005, "validation": "ok: 10000 of 10000 samples"},
              "k_gemm": {"speedup": 1.05, "aa_spread": 0.001, "validation": "incorrect: 17 of 10000 samples"}}
    for floor in floors.values():
        floor["floor_sha256"] = "f" * 64
    steps = []
    while (step := C.next_step(state, list(KERNELS))) is not None:
        steps.append(step)
        if step[0] == "floor":
            state.setdefault("floors", {})[step[1]] = dict(floors[step[1]])
        elif step[0].startswith("floor:"):
            part = step[0].removeprefix("floor:")
            state["floors"][step[1]].setdefault("judge", {})[part] = (
                {"speedup": 1.021, "aa_spread": 0.002, "peer": "flash_attn_4", "vs_peer": 1.04} if part == "op_level"
                else dict.fromkeys(("memcheck", "racecheck", "synccheck"), "clean"))
        else:
            do(state, step, {})
        assert len(steps) < 100
    assert steps[6:8] == [("floor:op_level", "k_varlen"), ("floor:sanitizer", "k_varlen")]
    assert steps[8][0] == "search" and not [s for s in steps[8:] if s[0].startswith("floor")]
    assert [C.floor_pays(state["floors"][k]) for k in KERNELS] == [True, False, False]
    text = C.markdown(state)
    assert "| k_dense | 1.0060x | 0.05% | ok: 10000 of 10000 samples | not judged: under the bar |" in text
    assert ("| k_varlen | 1.0220x | 0.04% | ok: 10000 of 10000 samples | 1.0210x (A/A 0.20%; flash_attn_4 1.040x) | "
            "memcheck clean, racecheck clean, synccheck clean |") in text
    assert "| k_gemm | 1.0500x | 0.10% | incorrect: 17 of 10000 samples | not judged: failed a check |" in text
    state["floors"]["k_varlen"]["judge"]["sanitizer"]["synccheck"] = "exit 99: 1 error"  # a floor the sanitizer flags
    assert not C.floor_correct(state["floors"]["k_varlen"]) and not C.floor_pays(state["floors"]["k_varlen"])
    assert "synccheck FAILED" in C.markdown(state)
    assert C.step_seconds("floor:op_level") == C.JUDGE_SECONDS["op_level"]


def test_classes_that_edit_stall_counts_start_their_walks_at_a_floor_that_passed_its_checks(tmp_path):
    state = fresh_state()
    state["floors"] = {"k_varlen": {"speedup": 1.02, "aa_spread": 0.001, "validation": "ok: 100000 of 100000 samples",
                                    "floor_sha256": "f" * 64}}
    starts = []

    def tune(factory, config, *, kernel, store_root):
        starts.append((config.moves, config.start))
        return fake_tune({config.moves: b"x"}, [])(factory, config, kernel=kernel, store_root=store_root)

    cell = compute.Cell("k_varlen", None, "k_varlen", None, "")
    for moves in ("alu", "control"):
        state["cells"][C.cell_key("k_varlen", moves)] = {"kernel": "k_varlen", "moves": moves, "runs": [],
                                                         "static": {"legal_moves": 5}}
        C.run_search(state, C.cell_key("k_varlen", moves), cell, 60.0, tmp_path, tune=tune)
    assert starts == [("alu", "original"), ("control", "floor")]
    assert state["cells"][C.cell_key("k_varlen", "control")]["runs"][0]["start"] == "floor"
    for failed in ({"error": "cut short"}, {"speedup": 1.02, "aa_spread": 0.001, "validation": "incorrect: 3 of 100000",
                                             "floor_sha256": "f" * 64}):
        state["floors"]["k_varlen"] = failed  # a floor that failed a check is no place to start
        C.run_search(state, C.cell_key("k_varlen", "control"), cell, 60.0, tmp_path, tune=tune)
    assert starts[2:] == [("control", "original")] * 2


def test_a_floor_recorded_before_its_hash_and_timed_shape_check_is_made_again():
    state = fresh_state()
    state["profiles"] = {k: {"samples": 1} for k in KERNELS}
    state["floors"] = {"k_varlen": {"speedup": 1.02, "aa_spread": 0.001, "validation": "ok: 10000 of 10000 samples"},
                       "k_dense": {"error": "cut short 2 times"}}
    assert C.next_step(state, list(KERNELS)) == ("floor", "k_varlen")  # the error is a record: not redone
    state["floors"]["k_varlen"]["floor_sha256"] = "f" * 64
    assert C.next_step(state, list(KERNELS)) == ("floor", "k_gemm")


def test_prepare_writes_the_static_state_on_a_cpu_and_runs_nothing(tmp_path, monkeypatch):
    """--prepare builds the state a GPU call resumes (the cubins a CPU host with the same CuTeDSL build
    compiles are the GPU host's): no GPU asked for, no step run."""
    monkeypatch.setattr(C.compute, "cells", lambda: {k: None for k in KERNELS})
    monkeypatch.setattr(C, "static_state", lambda cells, classes: fresh_state())
    monkeypatch.setattr(C.report, "require_gpu", lambda: pytest.fail("--prepare asked for a GPU"))
    monkeypatch.setattr(C, "campaign", lambda *a, **k: pytest.fail("--prepare ran a step"))
    monkeypatch.setattr(sys, "argv", ["sip_compute.py", "--state", str(tmp_path / "s"), "--prepare",
                                      "--classes", ";".join(CLASSES)])
    assert C.main() == 0
    state = json.loads((tmp_path / "s" / "state.json").read_text())
    assert set(state["kernels"]) == set(KERNELS) and "profiles" not in state


def test_a_search_from_the_floor_is_credited_only_with_what_it_added_to_the_floor(tmp_path):
    """A run that starts at the floor reports its best against the original (the floor's gain included) and
    against the floor (the same re-times): the table shows both, the promising cells are ranked by the
    second, and a winner that is the floor itself is not judged again as a search result where the floor is
    judged as the floor (it pays); where it does not, the stored floor is judged as the cell's winner."""
    floor_sha = hashlib.sha256(b"the floor").hexdigest()
    (tmp_path / "tuned.cubin").write_bytes(b"the floor")
    report = types.SimpleNamespace(
        finalists=[{"rel": 1 / 1.03, "validation": "ok", "digest": floor_sha, "over_start": 1.0}],
        search_seconds=300.0, total_seconds=330.0, iterations=500, evaluated=400, incorrect=0, crashed=0,
        runs=[{"exhausted": False}], aa_spread=0.001, bar=1.01, speedup=1.03, samples_passed=100000,
        cached=str(tmp_path), outcome="cached", gpu="H200", original_sha256="o" * 64, start_sha256=floor_sha,
        start_speedup=1.03)
    run = {**C.run_record(report, seed=17), "start": "floor", "exhausted": True}  # its search is done
    assert run["winner_is_start"] and run["best_speedup"] == pytest.approx(1.03) and run["best_over_start"] == 1.0
    state = fresh_state()
    key = C.cell_key("k_varlen", "alu")
    state["cells"][key]["runs"] = [run]
    assert math.isclose(C.best_margin(state["cells"][key]), -0.001)  # nothing past the floor and the A/A
    state["meta"] = {"gpu": "H200"}
    for k in KERNELS:
        state.setdefault("profiles", {})[k] = {"samples": 1, "hot_blocks": [], "headroom": 0.5, "sensitive": 0.1,
                                                "stalls": {}}
        state.setdefault("floors", {})[k] = {"speedup": 1.0, "aa_spread": 0.002, "floor_sha256": "f" * 64}
        for c in state["cells"].values():
            if c["kernel"] == k and not c["runs"]:
                c["runs"].append(a_run(best=1.0, exhausted=True))
    state["floors"]["k_varlen"] = {"speedup": 1.03, "aa_spread": 0.001, "floor_sha256": floor_sha,
                                   "validation": "ok: 100000 of 100000 samples",
                                   "judge": {"op_level": {"speedup": 1.03, "aa_spread": 0.001, "peer": "fa4",
                                                          "vs_peer": 1.04},
                                             "sanitizer": {"memcheck": "clean", "racecheck": "clean"}}}
    row = next(line for line in C.markdown(state).splitlines() if line.startswith("| k_varlen | `alu`"))
    assert "| 1.0300x | 1.0000x | 0.10% |" in row and "stored the floor itself: no gain over it" in row
    assert C.next_step(json.loads(json.dumps(state)), list(KERNELS)) is None  # no judging of the floor again
    state["floors"]["k_varlen"]["speedup"] = 1.005  # a floor under the bar is not judged as the floor
    assert C.next_step(json.loads(json.dumps(state)), list(KERNELS)) == ("retime", key)
    assert "stored, judging" in C.markdown(state)
    state["floors"]["k_varlen"]["speedup"] = 1.03
    run.update(winner_is_start=False, best_over_start=1.012, tuned_sha256="b" * 64)
    assert C.next_step(json.loads(json.dumps(state)), list(KERNELS)) == ("retime", key)
    del run["best_over_start"]  # a run from the floor recorded before the floor was re-timed beside it
    assert math.isnan(C.over_start(run)) and math.isnan(C.best_margin(state["cells"][key]))
    assert C.over_start({"best_speedup": 1.02}) == 1.02  # a run from the original: over its start as recorded


def test_store_floors_puts_each_floor_through_the_tuner_once_and_records_why_one_was_not_stored(tmp_path):
    """--store-floors: one tune() per kernel from the floor with no iteration, at the kernel's op and shape,
    into the given store; the record says whether the entry the store holds is this floor and whether it meets
    the loading bar; a failure is that kernel's record and is tried again by the next call, a success is not;
    no kernel starts without STORE_FLOOR_SECONDS left."""
    calls, broken = [], {"op_b"}

    def tune(factory, config, *, kernel, shape, store_root):
        calls.append((kernel, shape, config.budget_iters, config.start, config.moves))
        if kernel in broken:
            raise RuntimeError("worker died")
        entry = Path(store_root) / kernel
        entry.mkdir(parents=True, exist_ok=True)
        kept = b"an older, stronger entry" if kernel == "op_c" else b"floor of " + kernel.encode()
        (entry / "tuned.cubin").write_bytes(kept)
        (entry / "meta.json").write_text(json.dumps({"speedup": 1.03}))  # no checks recorded: below the bar
        return types.SimpleNamespace(outcome="cached 1.03x", cached=str(entry), speedup=1.03, aa_spread=0.001,
                                     start_sha256=hashlib.sha256(b"floor of " + kernel.encode()).hexdigest(),
                                     finalists=[{"validation": "ok: 100000 samples"}], op_level={"speedup": 1.03},
                                     gpu="FakeGPU")

    cells = {k: compute.Cell(k, None, f"op_{k[-1]}", f"shape_{k[-1]}", "") for k in ("k_a", "k_b", "k_c")}
    store = tmp_path / "store"
    done = C.store_floors(cells, store, tune=tune)
    assert [c[0] for c in calls] == ["op_a", "op_b", "op_c"] and calls[0][1:] == ("shape_a", 0, "floor", "control")
    assert done["k_a"]["stored_the_floor"] and done["k_a"]["speedup"] == 1.03 and done["k_a"]["below_the_bar"]
    assert not done["k_c"]["stored_the_floor"]  # the store kept another entry
    assert done["k_b"] == {"error": "RuntimeError: worker died"}
    assert json.loads((store / "floors.json").read_text()) == done
    calls.clear()
    broken.clear()
    again = C.store_floors(cells, store, tune=tune)
    assert [c[0] for c in calls] == ["op_b"] and again["k_b"]["stored_the_floor"]  # only the failed one again
    calls.clear()
    (store / "floors.json").unlink()
    now = [1000.0]
    C.store_floors(cells, store, deadline=1000.0 + C.STORE_FLOOR_SECONDS + 1, tune=tune, clock=lambda: now[0])
    assert [c[0] for c in calls] == ["op_a", "op_b", "op_c"]  # the fake clock stands still: every one fits
    calls.clear()
    (store / "floors.json").unlink()
    C.store_floors(cells, store, deadline=1000.0 + C.STORE_FLOOR_SECONDS - 1, tune=tune, clock=lambda: now[0])
    assert calls == [] and not (store / "floors.json").exists()
