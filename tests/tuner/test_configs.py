"""Level 1 of sip-tune on the CPU: the search space and its pruning (real kernels' plans and cost
models), `sip-tune --plan`, and the search end to end (sip_tune.configs.tune_configs) over a toy
kernel whose worker bench is a CPU stand-in that crashes, computes wrong results and times.

This module is also the toy kernel module (Config, Shape, config_for, candidates, compile,
workload): the worker process imports it by name, as it imports a real kernel module."""
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from store_samples import checks as entry_checks

import rosekernels
from rosekernels import contract, modes, tuned
from rosekernels.kernels import kernel_module
from rosekernels.kernels import attention_decode_plan, attention_plan, gemm_leakyrelu_plan, qk_norm_plan
from rosekernels.variant import Variant
from rosekernels.workload import Workload
from sip_tune import cli, configs, oplevel, probe, tuning, workloads
from sip_tune.runner import Options


# ---------------------------------------------------------------------------------------------
# The space: real plans, pruned by their cost models.

def test_gemm_decode_space_keeps_the_heuristic_and_the_cost_models_best():
    space = configs.plan("gemm_leakyrelu", "decode", {"m": 8, "n": 4096, "k": 4096}, max_candidates=24)
    shape = space.shape
    everything = gemm_leakyrelu_plan.candidates(shape)
    assert space.total == len(everything) > 25 and len(space.candidates) == 25 and space.pruned == space.total - 25
    assert space.candidates[0] == space.heuristic == gemm_leakyrelu_plan.config_for(shape)
    assert space.ranked_by == "rosekernels.kernels.gemm_leakyrelu_plan.rank"
    sms = modes.sm_count()

    def cost(c):
        return gemm_leakyrelu_plan.decode_cost(c, shape.m, shape.n, shape.k, sms)

    def fewest(c):  # swapped tiles, or plain ones loading the 8 rows of A that M = 8 needs
        return c.swap_ab or c.a_rows == 8
    # Plain configs loading more rows of A than exist come last, so the 24 kept are distinct
    # tile/split choices, best modelled first; both tile kinds are among them.
    assert all(fewest(c) for c in space.candidates)
    assert {c.swap_ab for c in space.candidates} == {False, True}
    kept = [cost(c) for c in space.candidates[1:]]
    assert kept == sorted(kept)  # best first
    dropped = [cost(c) for c in everything if c not in space.candidates and fewest(c)]
    assert max(kept) <= min(dropped)  # nothing pruned is modelled cheaper than what is kept
    assert len(set(space.candidates)) == 25 and all(c in everything for c in space.candidates)


def test_without_pruning_the_space_is_every_candidate():
    space = configs.plan("gemm_leakyrelu", "decode", {"m": 8, "n": 4096, "k": 4096}, max_candidates=10**6)
    assert space.pruned == 0 and set(space.candidates) == set(gemm_leakyrelu_plan.candidates(space.shape))
    only = configs.plan("gemm_leakyrelu", "decode", {"m": 8, "n": 4096, "k": 4096}, max_candidates=0)
    assert only.candidates == [space.heuristic] and only.pruned == space.total - 1


def test_gemm_prefill_space_is_ordered_by_the_wave_model():
    space = configs.plan("gemm_leakyrelu", "prefill", {"m": 4096, "n": 4096, "k": 4096})
    s, sms = space.shape, modes.sm_count()
    assert space.pruned == 0 and space.total == len(gemm_leakyrelu_plan.candidates(s))
    costs = [gemm_leakyrelu_plan.prefill_cost(s.m, s.n, s.k, c.tile_m, c.tile_n, c.pingpong, sms, c.cluster_m,
                                              c.cluster_n)[0] for c in space.candidates[1:]]
    assert costs == sorted(costs)


def test_prefill_cost_is_the_heuristics_model():
    """prefill_choice decides with prefill_cost (2x1 clusters): the cheapest tile it models is the pick,
    except where one cooperative wave makes it take pingpong 128x128."""
    for m, n, k in ((8192, 14336, 4096), (4096, 4096, 4096), (2048, 4096, 14336)):
        costs = {(tm, tn, pp): gemm_leakyrelu_plan.prefill_cost(m, n, k, tm, tn, pp, 132)
                 for tm, tn, pp, _ in gemm_leakyrelu_plan.PREFILL_TILES}
        best = min(costs, key=lambda t: costs[t][0])
        pick = gemm_leakyrelu_plan.prefill_choice(m, n, k, 132)
        assert pick == best or (costs[best][1] == 1 and not best[2] and pick == (128, 128, True))


def test_attention_decode_rank_orders_by_the_split_model():
    shape = attention_decode_plan.DecodeShape(batch=4, seqlen_kv=8192)
    found = attention_decode_plan.candidates(shape, 132)
    ranked = attention_decode_plan.rank(shape, found, 132)
    assert sorted(map(repr, ranked)) == sorted(map(repr, found))

    def us(c):
        splits, per, groups = attention_decode_plan.split_plan(c, shape, 132)
        return attention_decode_plan.launch_us(groups, splits, per, 4 * c.tile_n * c.head_dim, 132)
    assert [us(c) for c in ranked] == sorted(us(c) for c in found)
    # the heuristic's split count is the model's best for its tile (within the 3% a split must win by)
    assert us(ranked[0]) >= attention_decode_plan.SPLIT_GAIN * us(attention_decode_plan.config_for(shape, 132))


@pytest.mark.parametrize("shape", [attention_plan.AttentionShape(1, 4096, 32, 8, 64, "bf16", False),
                                   attention_plan.AttentionShape(8, 8192, 32, 8, 128, "fp16", True)])
def test_attention_prefill_space_stays_near_the_heuristic(shape):
    space = configs.plan("attention", "prefill", dataclasses.asdict(shape))
    home = attention_plan.config_for(shape)
    assert space.ranked_by.endswith("attention_plan.rank") and space.candidates[0] == home
    assert space.total == len(attention_plan.candidates(shape)) > len(space.candidates)

    def distance(c):
        fields = ("tile_m", "num_stages", "overlap", "persistent", "direct_o")
        return sum(getattr(c, f) != getattr(home, f) for f in fields) + abs(c.tile_n - home.tile_n) / 32
    kept = [distance(c) for c in space.candidates]
    assert kept == sorted(kept) and max(kept) <= min(map(distance, set(attention_plan.candidates(shape)) -
                                                         set(space.candidates)))
    # every one-field change of the heuristic that fits shared memory is searched
    for change in (dict(tile_m=320 - home.tile_m), dict(overlap=False), dict(persistent=False),
                   dict(num_stages=home.num_stages + 1), dict(tile_n=home.tile_n - 32), dict(direct_o=True)):
        try:
            near = dataclasses.replace(home, **change)
        except ValueError:  # more shared memory than a block gets
            continue
        assert near in space.candidates, change


def test_a_kernel_without_a_cost_model_keeps_its_own_order():
    space = configs.plan("qk_norm", "prefill", {"tokens": 4096}, max_candidates=5)
    assert space.ranked_by == "candidates order"
    rest = [c for c in qk_norm_plan.candidates(space.shape) if c != space.heuristic]
    assert space.candidates == [space.heuristic, *rest[:5]]
    decode = configs.plan("qk_norm", "decode", {"tokens": 1})
    assert decode.candidates == [qk_norm_plan.config_for(qk_norm_plan.QKNormShape(1))] and decode.total == 1


# ---------------------------------------------------------------------------------------------
# Bucket edges: where a level-1 winner is tested before it serves its bucket (real plans, CPU).

def _served(plan, shape, config, heuristic, name):
    """Every size of bucket(shape)'s range in `name` at which the entry serves (brute force)."""
    hi = getattr(contract.bucket(shape), name)
    out = []
    for v in range(hi // 2 + 1, hi + 1):
        s = dataclasses.replace(shape, **{name: v})
        if plan.config_for(s) == heuristic and config in plan.candidates(s):
            out.append(v)
    return out


def test_bucket_edges_are_the_smallest_and_largest_sizes_the_entry_serves():
    """attention_decode at batch 3, S_kv 5000 (bucket batch 3..4, S_kv 4097..8192): the heuristic's
    split count changes across the bucket, so the entry serves scattered sizes; the edges are the
    extreme ones (found by brute force here), and each edge shape is served."""
    shape = attention_decode_plan.DecodeShape(batch=3, seqlen_kv=5000)
    heuristic = attention_decode_plan.config_for(shape)
    for config in [c for c in attention_decode_plan.candidates(shape) if c != heuristic][:3]:
        edges = configs.bucket_edges("attention_decode", shape, config, heuristic, seed=5)
        served = _served(attention_decode_plan, shape, config, heuristic, "seqlen_kv")
        batches = _served(attention_decode_plan, shape, config, heuristic, "batch")
        assert len(served) < 8192 - 4096 and batches == [3]  # scattered: a scan from the ends alone misses them
        assert [(e.batch, e.seqlen_kv) for e in edges[:2]] == [(3, served[0]), (3, served[-1])]
        ragged = edges[2]
        assert len(edges) == 3 and served[0] < ragged.seqlen_kv < served[-1] and ragged.seqlen_kv in served
        for e in edges:
            assert contract.bucket(e) == contract.bucket(shape) and e != shape
            assert attention_decode_plan.config_for(e) == heuristic and config in attention_decode_plan.candidates(e)


def test_bucket_edges_leave_out_sizes_where_the_heuristic_picks_another_config():
    """qk_norm at 8 tokens on 132 SMs: 7 and 8 take the prefill kernel, 5 and 6 the decode one; an
    entry tuned at 8 serves 7 and 8 only."""
    shape = qk_norm_plan.QKNormShape(8)
    heuristic = qk_norm_plan.config_for(shape, 132)
    other = next(c for c in qk_norm_plan.candidates(shape, 132) if c != heuristic)
    assert configs.bucket_edges("qk_norm", shape, other, heuristic) == [dataclasses.replace(shape, tokens=7)]
    for m in (100, 8, 3000):
        gemm = gemm_leakyrelu_plan.GemmShape(m, 4096, 4096)
        h = gemm_leakyrelu_plan.config_for(gemm)
        config = [c for c in gemm_leakyrelu_plan.candidates(gemm) if c != h][0]
        edges = configs.bucket_edges("gemm_leakyrelu", gemm, config, h, seed=1)
        served = _served(gemm_leakyrelu_plan, gemm, config, h, "m") if m <= 128 else None
        if served is not None:  # the extremes (the tuned size itself left out), and sizes it serves
            sizes = {e.m for e in edges}
            assert min(sizes | {m}) == served[0] and max(sizes | {m}) == served[-1] and sizes <= set(served)
        assert edges and all(e.m != m and contract.bucket(e) == contract.bucket(gemm) for e in edges)
    one = qk_norm_plan.QKNormShape(1)  # a bucket of one size
    assert configs.bucket_edges("qk_norm", one, heuristic, qk_norm_plan.config_for(one, 132)) == []


def test_describe_starts_with_the_variant_key_then_the_launch_policy():
    cfg = gemm_leakyrelu_plan.GemmConfig(tile_m=64, tile_n=128, cluster_m=1, split_k=True, a_rows=8, splits=5)
    assert configs.describe(cfg) == f"{cfg.variant().key()} splits=5 raster_group=8"
    q = qk_norm_plan.config_for(qk_norm_plan.QKNormShape(1))
    assert configs.describe(q) == q.variant().key()  # everything compiled in, mode included


# ---------------------------------------------------------------------------------------------
# sip-tune --plan, --levels.

def run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_one_line_per_candidate_then_the_counts(capsys):
    code, out, _ = run(capsys, "--kernel", "gemm_leakyrelu", "--mode", "decode", "--shape", "m=8,n=4096,k=4096",
                       "--plan", "--max-candidates", "10")
    lines = out.strip().splitlines()
    space = configs.plan("gemm_leakyrelu", "decode", {"m": 8, "n": 4096, "k": 4096}, 10)
    assert code == 0 and len(lines) == 12
    assert [line.split()[0] for line in lines[:-1]] == [c.variant().key() for c in space.candidates]
    assert lines[0].endswith("(heuristic)") and "splits=" in lines[1]
    assert lines[-1] == f"{space.total} candidates (11 after pruning by rosekernels.kernels.gemm_leakyrelu_plan.rank)"


def test_the_plan_command_runs_without_a_gpu(tmp_path):
    env = dict(os.environ, ROSEKERNELS_CACHE_DIR=str(tmp_path), SIP_CACHE_DIR=str(tmp_path / "sip"))
    out = subprocess.run([sys.executable, "-m", "sip_tune.cli", "--kernel", "gemm_leakyrelu", "--mode", "decode",
                          "--shape", "m=8,n=4096,k=4096", "--plan"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].endswith(f"({configs.MAX_CANDIDATES + 1} after pruning by "
                                                          "rosekernels.kernels.gemm_leakyrelu_plan.rank)")


@pytest.mark.parametrize("argv, code, message", [
    (["--levels", "config,fast"], 2, "--levels"),
    (["--levels", "sass,sass"], 2, "--levels"),
    (["--levels", ""], 2, "--levels"),
    (["--max-candidates", "-1"], 2, "--max-candidates"),
    (["--plan", "--shape", "tokens=1"], 2, "unknown shape keys"),
    (["--plan", "--mode", "decode", "--shape", "m=4096"], 2, "selects the prefill variant"),
])
def test_level_and_plan_errors(capsys, argv, code, message):
    got, _, err = run(capsys, "--kernel", "gemm_leakyrelu", *argv)
    assert got == code and message in err


# ---------------------------------------------------------------------------------------------
# The toy kernel (this module, seen through rosekernels.KERNELS["toy"]).

OP = "toy"


@dataclasses.dataclass(frozen=True)
class Config:
    POLICY_FIELDS = ("splits",)
    block: int = 2  # compiled in
    splits: int = 1  # launch policy

    def variant(self):
        return Variant.of(OP, "decode", block=self.block)


@dataclasses.dataclass(frozen=True)
class Shape:
    SIZE_FIELDS = ("n",)
    n: int = 48

    @classmethod
    def defaults(cls, mode):
        return cls()


# Per config: modelled and "measured" microseconds, and what goes wrong. The heuristic (2, 1)
# takes 10 us; (8, 3) would be fastest but crashes its worker, (4, 2) computes garbage, (4, 3)
# differs from the heuristic in the last bits but passes the float64 check, (1, 3) crashes only
# inside a timing graph.
US = {(1, 1): 12.0, (1, 2): 12.5, (1, 3): 11.0, (2, 1): 10.0, (2, 2): 10.4, (2, 3): 10.3,
      (4, 1): 9.6, (4, 2): 8.5, (4, 3): 9.0, (8, 1): 9.9, (8, 2): 11.0, (8, 3): 8.0}
CRASH_IN_TEST, WRONG, INEXACT, CRASH_IN_TIMING = (8, 3), (4, 2), (4, 3), (1, 3)


def config_for(shape):
    return Config(2, 1)


def candidates(shape):
    return [Config(b, s) for b in (1, 2, 4, 8) for s in (1, 2, 3)]


def rank(shape, found):
    return sorted(found, key=lambda c: US[c.block, c.splits] * (1.1 if c.block == 8 else 1.0))


def compile(config):
    return SimpleNamespace(cubin_sha256=hashlib.sha256(b"toy-%d" % config.block).hexdigest(), config=config)


def workload(config, shape):
    return Workload(compile(config), make_args=lambda seed: (seed, shape.n), outputs=lambda args: args[:1])


class CpuConfigBench:
    """Answers as runner.ConfigBench does, from the table above; the A/A pair measures 0.3% apart."""

    def __init__(self, space, options):
        self.space = space
        self.keys = [(c.block, c.splits) for c in space.configs]
        assert self.keys[0] == (2, 1)

    def info(self):
        return {"gpu": "Fake H200", "base_us": US[2, 1], "launches_per_graph": 100, "input_sets": 7,
                "bytes_cycled": 7 << 20, "pid": os.getpid(), "configs": len(self.keys)}

    def test(self, i, seed, samples):
        key = self.keys[i]
        if key == CRASH_IN_TEST:
            os._exit(9)  # an illegal address: the worker dies
        verdict = {"load_s": 0.0, "test_s": 0.0, "detail": "", "bitwise": key not in (WRONG, INEXACT),
                   "max_err": 0.5 if key == INEXACT else math.nan, "status": "ok"}
        if key == WRONG:
            verdict.update(status="incorrect", max_err=math.nan, detail="sample 0: error 3.2 > 1")
        return verdict

    def time(self, indices, reps):
        if any(self.keys[i] == CRASH_IN_TIMING for i in indices):
            os._exit(9)
        us = [US[2, 1], US[2, 1] * 1.003] + [US[self.keys[i]] for i in indices]
        return {"median_us": us, "rel": [u / us[0] for u in us], "reps": reps, "launches_per_graph": 100}

    def validate(self, i, seed, samples, edges, edge_samples):
        """(4, 3) differs from the heuristic past its float64 tolerance at the bucket's largest size."""
        assert [e.n for e in edges][:2] == [33, 64] and samples == 10_000  # the bucket (32, 64] of n = 48
        out = {"status": "ok", "bitwise": self.keys[i] != INEXACT, "max_err": math.nan, "passed": samples,
               "shape_passed": edge_samples, "edges_passed": edge_samples * len(edges), "seconds": 0.0, "detail": ""}
        if self.keys[i] == INEXACT and any(e.n == 64 for e in edges):
            return {**out, "status": "incorrect", "passed": 0, "detail": "at bucket edge Shape(n=64): error 1.4 > 1"}
        return out


class CrashingValidationBench(CpuConfigBench):
    """The worker dies while it validates (8, 1): a crash that says nothing about the candidate."""

    def validate(self, i, *args):
        if self.keys[i] == (8, 1):
            os._exit(9)
        return super().validate(i, *args)


# The public op re-timed in a fresh process (sip_tune.oplevel, faked): (4, 1) does not hold its
# worker-measured gain there (1.002x, inside the A/A spread of 0.004).
OP_LEVEL = {(4, 1): 1.002, (8, 1): 1.02, (4, 3): 1.08}
RETIMED = []  # (kernel, shape, config key, heuristic, original hash) of each op-level re-time


def fake_retime(kernel, shape, candidate, rounds=None, **kw):
    key = (candidate.config.block, candidate.config.splits)
    RETIMED.append((kernel, shape, key, candidate.heuristic, candidate.original_sha256))
    if OP_LEVEL[key] is None:  # the process did not come back
        return oplevel.OpTiming(kernel, shape=dataclasses.asdict(shape), error="the op-level process failed "
                                "(exit -1): timed out after 900 s")
    return oplevel.OpTiming(kernel, "rosekernels.toy", dataclasses.asdict(shape), "config", "Fake H200",
                            heuristic_us=10.0, tuned_us=10.0 / OP_LEVEL[key], speedup=OP_LEVEL[key],
                            aa_spread=0.004, rounds=rounds)


# compute-sanitizer (sip_tune.probe.sanitize, faked): per config, the tools that report an error.
FLAGGED = {}
SANITIZED = []  # the configs run under it, and their shapes


def fake_sanitize(factory, cubin, tools=probe.SANITIZER_TOOLS, **kw):
    _, config, shape = factory.args  # configs.workload_factory's partial
    assert cubin is None and factory().kernel.config == config  # the config's own kernel, as compiled
    SANITIZED.append(((config.block, config.splits), shape))
    flagged = FLAGGED.get((config.block, config.splits), ())
    return {t: "exit 99: ========= Invalid __global__ read" if t in flagged else "clean" for t in tools}


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setitem(rosekernels.KERNELS, OP, __name__)
    monkeypatch.setattr(tuned, "current_toolchain", lambda: "test-toolchain")
    monkeypatch.setattr(configs.oplevel, "retime", fake_retime)
    monkeypatch.setattr(configs.probe, "sanitize", fake_sanitize)
    monkeypatch.setattr(configs.probe, "sanitizer_problem", lambda: None)  # a GPU host has compute-sanitizer
    RETIMED.clear()
    SANITIZED.clear()
    FLAGGED.clear()
    tuned.forget_configs()
    yield tmp_path
    tuned.forget_configs()


def test_toy_plan_prunes_by_its_rank(toy):
    space = configs.plan(OP, "decode", max_candidates=4)
    assert space.ranked_by == f"{__name__}.rank" and space.total == 12
    assert [(c.block, c.splits) for c in space.candidates] == [(2, 1), (4, 2), (8, 3), (4, 3), (4, 1)]


def test_tune_configs_end_to_end_with_a_cpu_bench(toy):
    logs = []
    report = configs.tune_configs(OP, "decode", max_candidates=100, processes=1, store_root=toy, log=logs.append,
                                  bench=CpuConfigBench, options=Options(eval_timeout_s=60, start_timeout_s=120))
    rows = {(r["config"]["block"], r["config"]["splits"]): r for r in report.candidates}
    assert len(rows) == 12 and report.candidates[0]["config"] == {"block": 2, "splits": 1}
    assert rows[CRASH_IN_TEST]["status"] == "crash"
    assert rows[WRONG]["status"] == "incorrect" and "error 3.2" in rows[WRONG]["detail"]
    assert rows[CRASH_IN_TIMING]["status"] == "crash" and rows[CRASH_IN_TIMING]["detail"].startswith("in timing")
    assert rows[INEXACT]["status"] == "ok" and not rows[INEXACT]["bitwise"] and rows[INEXACT]["max_err"] == 0.5
    assert all(rows[k]["status"] == "ok" and rows[k]["bitwise"] for k in US if k not in
               (CRASH_IN_TEST, WRONG, INEXACT, CRASH_IN_TIMING))
    assert rows[4, 1]["median_us"] == 9.6 and rows[4, 1]["rel"] == pytest.approx(0.96)
    assert report.aa_spread == pytest.approx(0.003) and report.heuristic_us == 10.0
    # every variant compiled once; rows of one variant share its time
    assert rows[4, 1]["compile_s"] == rows[4, 3]["compile_s"] >= 0
    # The three fastest passing ones are re-timed, all past the bar (1.01x); fastest first, (4, 3)
    # fails at its bucket's largest size, (4, 1) does not hold at the op level; (8, 1) wins.
    keys = [configs.describe(Config(4, 3)), configs.describe(Config(4, 1)), configs.describe(Config(8, 1))]
    assert [f["key"] for f in report.finalists] == keys
    verdicts = [f["verdict"] for f in report.finalists]
    assert verdicts[0] == "refused: at bucket edge Shape(n=64): error 1.4 > 1"
    assert verdicts[1] == "refused at the op level: 1.0020x" and verdicts[2] == "verified: 1.0200x at the op level"
    assert [r[2] for r in RETIMED] == [(4, 1), (8, 1)] and RETIMED[0][:2] == (OP, Shape())
    assert RETIMED[0][3:] == (Config(2, 1), compile(Config(2, 1)).cubin_sha256)
    assert report.winner == {"block": 8, "splits": 1} and report.speedup == 1.02  # the op-level speedup
    assert report.tuned_us == pytest.approx(10 / 1.02) and "stored at" in report.outcome
    assert "through rosekernels.toy" in report.outcome and "(the public op, fresh process)" in report.text()
    assert set(report.shares) == {"compile", "test", "time", "verify"} and 0 < sum(report.shares.values()) <= 1
    # the store has it, keyed by the heuristic's cubin, and the op-side lookup gives it back
    entry = tuned.lookup_config(toy, kernel_module(OP), Shape(), Config(2, 1), compile(Config(2, 1)).cubin_sha256)
    assert entry is not None and str(entry.path) == report.stored and entry.config == Config(8, 1)
    assert entry.meta["speedup"] == 1.02 and entry.meta["aa_spread"] == pytest.approx(0.003)
    # with how it was checked, meeting the store's bar: the counts the worker measured, compute-sanitizer
    # on the winner alone (it ran after the op-level re-time)
    checks = entry.meta["checks"]
    assert entry.problems == [] and checks["samples"] == {"run": 10_000, "passed": 10_000}
    assert checks["compare"] == "reference" and checks["op_level"]["speedup"] == 1.02
    assert checks["shapes"]["tuned"] == {"n": 48} and [e["n"] for e in checks["shapes"]["edges"]][:2] == [33, 64]
    assert checks["shapes"]["tuned_samples"] == 4 and checks["shapes"]["edge_samples"] == 4 * len(
        checks["shapes"]["edges"])
    assert checks["sanitizer"] == dict.fromkeys(probe.SANITIZER_TOOLS, "clean") and SANITIZED == [((8, 1), Shape())]
    other_build = compile(Config(4, 3)).cubin_sha256
    assert tuned.lookup_config(toy, kernel_module(OP), Shape(), Config(2, 1), other_build) is None
    assert configs.chosen(report) == (Config(8, 1), Shape())
    assert "crash" in report.text() and "12 candidates" in report.text()


def test_when_no_finalist_holds_where_it_serves_the_heuristic_stays(toy, monkeypatch):
    monkeypatch.setitem(OP_LEVEL, (8, 1), 0.99)
    report = configs.tune_configs(OP, "decode", max_candidates=100, processes=1, store_root=toy, log=lambda m: None,
                                  bench=CpuConfigBench, options=Options(eval_timeout_s=60, start_timeout_s=120))
    assert report.winner is None and report.settled and report.speedup == 1.0
    assert "no candidate past the bar held" in report.outcome and "0.9900x" in report.outcome
    [entry] = tuned.config_entries(toy, kernel_module(OP))  # recorded: the heuristic stays
    assert entry.config == entry.heuristic == Config(2, 1) and entry.problems == []


def _search(toy, **kw):
    return configs.tune_configs(OP, "decode", max_candidates=100, processes=1, store_root=toy, log=lambda m: None,
                                **{"bench": CpuConfigBench, "options": Options(eval_timeout_s=60, start_timeout_s=120),
                                   **kw})


def test_a_search_that_beats_no_stored_entry_keeps_it_and_says_so(toy):
    """The bucket's entry is better checked, or as well and faster, than what this search found: the
    store keeps it, and the outcome does not claim the winner was stored."""
    heuristic = Config(2, 1)
    path, _ = tuned.store_config(toy, kernel_module(OP), Shape(), Config(4, 1), heuristic,
                                 compile(heuristic).cubin_sha256,
                                 {"speedup": 5.0, "checks": entry_checks("config", speedup=5.0)})
    report = _search(toy)
    assert report.winner == {"block": 8, "splits": 1} and report.stored == str(path)
    assert f"the entry at {path} is kept" in report.outcome and "stored at" not in report.outcome
    assert tuned.lookup_config(toy, kernel_module(OP), Shape(), heuristic,
                               compile(heuristic).cubin_sha256).config == Config(4, 1)


@pytest.mark.parametrize("failure", ["op level", "validation"])
def test_a_finalist_whose_check_failed_to_run_leaves_the_bucket_unrecorded(toy, monkeypatch, failure):
    """The other finalists are refused on their merits, (8, 1) by a check that did not come back: the
    search cannot tell that the heuristic stays, so it records nothing and the next run searches the
    bucket again."""
    if failure == "op level":
        monkeypatch.setitem(OP_LEVEL, (8, 1), None)
    report = _search(toy, bench=CrashingValidationBench if failure == "validation" else CpuConfigBench)
    assert report.winner is None and not report.settled and not report.stored
    verdict = report.finalists[-1]["verdict"]
    assert verdict.startswith("not checked" + (" at the op level: the op-level process failed" if failure == "op level"
                                               else ": the validation request failed (crash"))
    assert report.outcome.endswith(f"{configs.NOT_SETTLED}: a check failed to run")
    assert tuned.config_entries(toy, kernel_module(OP)) == []


def test_a_finalist_compute_sanitizer_flags_is_refused_on_its_merits(toy):
    """(8, 1) passes everywhere but memcheck: refused, and as the heuristic's kernel runs clean the
    finding is the candidate's: the heuristic stays, recorded."""
    FLAGGED[8, 1] = ("memcheck",)
    report = _search(toy)
    assert report.winner is None and report.settled
    assert report.finalists[-1]["verdict"].startswith("refused: compute-sanitizer: memcheck exit 99")
    assert SANITIZED == [((8, 1), Shape()), ((2, 1), Shape())]  # the heuristic, asked once
    [entry] = tuned.config_entries(toy, kernel_module(OP))
    assert entry.config == entry.heuristic == Config(2, 1)


def test_when_the_heuristic_fails_compute_sanitizer_too_nothing_is_recorded(toy):
    FLAGGED[8, 1] = FLAGGED[2, 1] = ("racecheck",)
    report = _search(toy)
    assert report.winner is None and not report.settled and not report.stored
    assert "does not pass the heuristic either (racecheck exit 99" in report.finalists[-1]["verdict"]
    assert tuned.config_entries(toy, kernel_module(OP)) == []


def test_compute_sanitizer_is_needed_unless_the_user_does_without(toy, monkeypatch):
    monkeypatch.setattr(configs.probe, "sanitizer_problem", lambda: "compute-sanitizer not found on PATH")
    with pytest.raises(probe.ProbeError, match="compute-sanitizer not found on PATH.*--no-sanitize"):
        _search(toy)
    assert not RETIMED  # refused before any work
    report = _search(toy, sanitize=False)
    [entry] = tuned.config_entries(toy, kernel_module(OP))
    assert report.winner == {"block": 8, "splits": 1} and not SANITIZED
    assert entry.meta["checks"]["sanitizer"] == "not run" and entry.problems == ["compute-sanitizer not run"]


def test_below_the_bar_the_heuristic_is_recorded_as_the_buckets_config(toy):
    report = configs.tune_configs(OP, "decode", max_candidates=3, processes=1, store_root=toy, log=lambda m: None,
                                  bench=CpuConfigBench, min_speedup=1.2)
    assert report.winner is None and report.finalists and "the heuristic stays" in report.outcome
    assert report.settled and "recorded at" in report.outcome
    [entry] = tuned.config_entries(toy, kernel_module(OP))
    assert str(entry.path) == report.stored and entry.config == entry.heuristic == Config(2, 1)
    assert entry.speedup == 1.0 and "the heuristic stays" in entry.meta["outcome"]
    # a later, better result replaces the record
    better = configs.tune_configs(OP, "decode", max_candidates=100, processes=1, store_root=toy,
                                  log=lambda m: None, bench=CpuConfigBench)
    assert better.winner is not None and better.stored == report.stored
    [entry] = tuned.config_entries(toy, kernel_module(OP))
    assert entry.config == Config(**better.winner) and entry.speedup > 1
    assert configs.chosen(report) == (Config(2, 1), Shape())


def test_compile_configs_compiles_each_variant_once_in_parallel(toy):
    seconds = configs.compile_configs(compile, candidates(Shape()), processes=2)  # the workers unpickle it
    assert sorted(seconds) == sorted({c.variant().key() for c in candidates(Shape())})
    assert all(s >= 0 for s in seconds.values())


# ---------------------------------------------------------------------------------------------
# The CLI's levels: level 2 anneals the level-1 winner's config; --levels sass is today's run.

@pytest.fixture
def cli_toy(toy, monkeypatch):
    calls = {}

    def fake_tune_configs(kernel, mode, shape, **kw):
        calls["configs"] = (kernel, mode, shape, kw)
        return configs.ConfigReport(kernel, mode, {"n": 48}, {"block": 2, "splits": 1},
                                    winner={"block": 4, "splits": 3})

    def fake_tune(factory, config, kernel=None, shape=None, store_root=None):
        calls["sass"] = (factory, config, kernel, store_root)
        calls["shape"] = shape
        return tuning.TuneReport(kernel, "v", "decode", outcome="fake")

    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(cli.probe, "sanitizer_problem", lambda: None)  # a GPU host has compute-sanitizer
    monkeypatch.setattr(configs, "tune_configs", fake_tune_configs)
    monkeypatch.setattr(tuning, "tune", fake_tune)
    return calls


def _plus_one_check(args):
    """The stand-in workloads' check: y = x + 1 within 0.01."""
    x, y, _ = args
    err = (y.double() - (x.double() + 1)).abs().max().item()
    assert err <= 0.01, f"error {err:.3g} > 0.01"
    return err / 0.01

def test_level_two_anneals_the_winners_config(cli_toy, capsys, toy):
    code, out, _ = run(capsys, "--kernel", OP, "--budget-iters", "5", "--store-root", str(toy), "--json",
                       str(toy / "r.json"))
    assert code == 0 and "level 1" in out and "fake" in out
    kernel, mode, shape, kw = cli_toy["configs"]
    assert (kernel, mode, shape, kw["store_root"]) == (OP, "decode", {}, str(toy))
    factory, config, kernel, root = cli_toy["sass"]
    assert root == str(toy)  # both levels write into the store --store-root names
    built = factory()
    assert built.kernel.config == Config(4, 3) and built.name == OP and config.budget_iters == 5
    assert cli_toy["shape"] == Shape() and kw["validation_samples"] == 10_000  # the op-level re-time's shape
    assert set(json.loads((toy / "r.json").read_text())) == {"config", "sass"}


def test_levels_sass_is_the_plain_annealing_run(cli_toy, capsys, toy):
    code, out, _ = run(capsys, "--kernel", OP, "--levels", "sass", "--budget-iters", "5", "--shape", "n=40",
                       "--json", str(toy / "r.json"))
    assert code == 0 and "configs" not in cli_toy and "level 1" not in out
    factory = cli_toy["sass"][0]
    assert cli_toy["shape"] == Shape(40)
    plain = workloads.factory(OP, "decode", {"n": 40})
    assert (factory.func, factory.args) == (plain.func, plain.args)
    assert factory().kernel.config == Config(2, 1)
    assert json.loads((toy / "r.json").read_text())["outcome"] == "fake"  # today's format


# ---------------------------------------------------------------------------------------------
# The config worker's verdicts (runner.ConfigBench.test), on CPU tensors: its comparison and
# reference-check logic, without the GPU set-up of its constructor.

def _cpu_workload(offset, check=True, size=16, test_offset=None):
    """y = x + 1 over `size` elements, with `offset` added to element 0 (0: the heuristic's result;
    test_offset: the offset on its test sizes, odd ones of 1-64, default `offset`); the float64 check
    accepts an error up to 0.01."""
    import torch

    def make_args(seed, n=size, bump=offset):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        return x, torch.full_like(x, math.nan), torch.tensor(bump)

    def test_args(seed):
        return make_args(seed, 2 * (seed % 32) + 1, offset if test_offset is None else test_offset)

    def launch(fn, args):
        x, y, bump = args
        torch.add(x, 1, out=y)
        y[0] += bump

    return Workload(SimpleNamespace(fn=None), make_args, outputs=lambda a: a[1:2], launch=launch,
                    check=_plus_one_check if check else None, test_args=test_args)


def cpu_config_bench(*workloads, at=None):
    """ConfigBench's request logic over CPU workloads; at(i, shape): configs[i]'s workload at a shape."""
    import torch

    from sip_tune.runner import ConfigBench

    bench = ConfigBench.__new__(ConfigBench)
    bench.torch, bench.o, bench.workloads = torch, Options(), dict(enumerate(workloads))
    bench.space = SimpleNamespace(workload_at=at)
    return bench


def test_the_config_worker_validates_at_the_tuned_shape_the_edges_and_the_test_sizes():
    """Candidate 1 matches the heuristic everywhere; 2 is wrong only at the bucket's largest shape;
    3 is right at every shape tested but off on its own test sizes; 4 differs slightly at one edge
    (within the float64 check)."""
    def at(i, shape):
        bad = {2: 0.5 if shape == "largest" else 0.0, 4: 1e-3 if shape == "smallest" else 0.0}.get(i, 0.0)
        return _cpu_workload(bad, size=3 if shape == "smallest" else 61)

    bench = cpu_config_bench(_cpu_workload(0.0), _cpu_workload(0.0), _cpu_workload(0.0),
                             _cpu_workload(0.0, test_offset=0.2), _cpu_workload(0.0), at=at)
    ok = bench.validate(1, 9, 300, ["smallest", "largest"], 3)
    assert ok["status"] == "ok" and ok["bitwise"] and ok["passed"] == 300
    assert ok["shape_passed"] == 3 and ok["edges_passed"] == 6  # counted as they passed: at the shape, at the edges
    edge = bench.validate(2, 9, 300, ["smallest", "largest"], 3)
    assert edge["status"] == "incorrect" and edge["detail"].startswith("at bucket edge largest: sample 0: error 0.5")
    assert edge["passed"] == 0 and edge["shape_passed"] == 3 and edge["edges_passed"] == 3
    sizes = bench.validate(3, 9, 300, ["smallest", "largest"], 3)
    assert sizes["status"] == "incorrect" and sizes["detail"].startswith("test sample 0: error 0.2")
    close = bench.validate(4, 9, 50, ["smallest", "largest"], 3)
    assert close["status"] == "ok" and not close["bitwise"] and close["max_err"] == pytest.approx(0.1, rel=1e-3)


def test_the_config_worker_compares_bitwise_then_checks_against_the_reference():
    bench = cpu_config_bench(_cpu_workload(0.0), _cpu_workload(0.0), _cpu_workload(1e-3), _cpu_workload(0.5),
                             _cpu_workload(1e-3, check=False))
    same = bench.test(1, 5, 3)
    assert same["status"] == "ok" and same["bitwise"] and math.isnan(same["max_err"])
    close = bench.test(2, 5, 3)
    assert close["status"] == "ok" and not close["bitwise"] and close["max_err"] == pytest.approx(0.1, rel=1e-3)
    wrong = bench.test(3, 5, 3)
    assert wrong["status"] == "incorrect" and wrong["detail"].startswith("sample 0: error 0.5")
    unchecked = bench.test(4, 5, 3)
    assert unchecked["status"] == "incorrect" and "has no check" in unchecked["detail"]


def _claiming_workload(rezero):
    """y = x + 1 by a kernel that claims its work from a counter (args[2], zero at launch): a launch
    that finds it set does nothing, as a persistent kernel's tile counter makes it; `rezero`: the
    kernel returns the counter to zero when done, as the ops, which reuse it, need."""
    import torch

    def make_args(seed, n=16):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        return x, torch.full_like(x, math.nan), torch.zeros(1, dtype=torch.int32)

    def launch(fn, args):
        x, y, counter = args
        if int(counter) == 0:
            torch.add(x, 1, out=y)
        counter += 1
        if rezero:
            counter.zero_()

    return Workload(SimpleNamespace(fn=None), make_args, outputs=lambda a: a[1:2], launch=launch,
                    check=_plus_one_check, test_args=lambda seed: make_args(seed, 2 * (seed % 32) + 1))


def test_a_config_that_leaves_its_counter_set_is_refused():
    """Fresh arguments per sample hide a counter left set (the first launch does all the work); the
    op's second launch on the same counter would skip it, so the worker checks the counter too."""
    from sip_tune.runner import SCRATCH_LEFT

    keeps = _claiming_workload(rezero=False)
    args = keeps.make_args(1)
    keeps.run(None, args)
    args[1].fill_(math.nan)
    keeps.run(None, args)  # what the op's next call would get
    assert args[1].isnan().all()
    bench = cpu_config_bench(_cpu_workload(0.0), _claiming_workload(rezero=True), keeps,
                             at=lambda i, shape: _claiming_workload(rezero=i == 1))
    assert bench.test(1, 5, 3)["status"] == "ok" and bench.validate(1, 9, 40, ["edge"], 2)["status"] == "ok"
    test = bench.test(2, 5, 3)
    assert test["status"] == "incorrect" and test["detail"] == f"sample 0: {SCRATCH_LEFT}"
    at_shape = bench.validate(2, 9, 40, [], 2)
    assert at_shape["status"] == "incorrect" and at_shape["detail"] == f"at the tuned shape: sample 0: {SCRATCH_LEFT}"
    on_sizes = bench.validate(2, 9, 40, [], 0)  # nothing at the shapes: the float64 check's own samples
    assert on_sizes["status"] == "incorrect" and on_sizes["detail"] == f"test sample 0: {SCRATCH_LEFT}"
