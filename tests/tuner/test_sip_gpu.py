"""The tuner on the GPU: the energy resolves real differences, broken and crashing candidates are caught,
and a tuned qk_norm cubin goes through the tuned store into a fresh process's warmup unchanged in results.

Every test spawns worker processes (a few seconds each); the whole file takes a few minutes."""
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

from rosekernels import paths, tuned
from rosekernels.workload import Workload
from sip import profile
from sip.mutate import with_extra_stalls
from sip_tune import probe, tuning, workloads
from sip_tune.runner import Runner

pytestmark = pytest.mark.gpu

QK_DECODE = workloads.factory("qk_norm", "decode")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private tuned store; the compile cache stays shared (workers reuse the parent's compiles)."""
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "sip"))
    return tmp_path / "sip"


def demo_workload() -> Workload:
    """Any CuTeDSL kernel can be tuned: compile it through jit and say how to feed it."""
    import torch

    import jit_demo_kernel as demo
    from rosekernels import jit

    kernel = jit.compile_variant(jit.Variant.of("axpb_test", "decode", dtype="fp32"), demo.build)

    def make_args(seed: int) -> tuple:
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(4099, device="cuda", generator=g)  # one wave: latency-bound, stalls show
        return x, torch.full_like(x, math.nan)

    return Workload(kernel, make_args, outputs=lambda a: a[1:])


# ---------------------------------------------------------------------------------------------
# Cubins made wrong on purpose, with the engine's decoder (no legality checks).

def _decoded(cubin: bytes):
    from sip import cubin as elf, sass

    parsed = elf.parse_cubin(cubin)
    code = max(parsed.kernels(), key=lambda k: k.instruction_count)
    return parsed, sass.disassemble_kernel(parsed, code.name)


def _address_regs(ins) -> set:
    """Register ids of the 64-bit address in a memory operand such as desc[UR4][R2.64+0x10]."""
    from sip import sass

    regs = set()
    for op in ins.operands:
        if "[" in op:
            for m in re.finditer(r"\bR(\d+)", op.split("][")[-1]):
                regs |= {sass.R_BASE + int(m.group(1)), sass.R_BASE + int(m.group(1)) + 1}
    return regs


def store_before_its_data(cubin: bytes) -> bytes:
    """An STG moved up past every instruction of its block that computes the value it stores: the
    addresses stay right, the stored values are stale registers. Incorrect, but no crash. (Moved past
    only the last producer, the store can still read the new value: a store reads its data some
    cycles after it issues, and a fixed-latency producer issued next may be done by then. With the
    norms launched with PDL, that candidate passed 100 of 100 samples on the H200.)"""
    parsed, k = _decoded(cubin)
    ins = k.instructions
    for s in (i for i in ins if i.base == "STG"):
        addr = _address_regs(s)
        data = s.reads - addr
        block = k.blocks[k.block_of[s.index]]
        producers = [i for i in block if i < s.index and ins[i].writes & data]
        if not producers:
            continue
        p = producers[0]
        span = ins[p:s.index]
        if any(i.writes & addr or i.control_flow for i in span):
            continue
        order = list(range(len(ins)))
        order.remove(s.index)
        order.insert(p, s.index)
        text = b"".join(ins[i].word.to_bytes(16, "little") for i in order)
        return parsed.with_text(k.name, text)
    raise AssertionError("no STG whose data producer sits in its block with the address computed before")


def store_to_null(cubin: bytes) -> bytes:
    """The first STG's address register replaced by RZ: the store goes to address 0 and the launch
    fails with an illegal address."""
    parsed, k = _decoded(cubin)
    s = next(i for i in k.instructions if i.base == "STG")
    word = s.word | (0xFF << 24)  # Ra (bits 24-31 of a memory instruction) := RZ
    text = bytearray(parsed.text(k.name))
    text[s.offset:s.offset + 16] = word.to_bytes(16, "little")
    out = parsed.with_text(k.name, bytes(text))
    _, k2 = _decoded(out)
    assert "RZ" in k2.instructions[s.index].operands[0], k2.instructions[s.index].text  # encoding check
    return out


# ---------------------------------------------------------------------------------------------

def test_energy_resolves_extra_stalls_and_candidates_are_cheap(env):
    original = QK_DECODE().kernel.cubin
    with Runner(QK_DECODE) as runner:
        info = runner.start()
        print("\nworker:", json.dumps(info))
        same = [runner.evaluate(original, seed=s) for s in range(3)]  # the base graph vs a second graph
        near = [runner.evaluate(with_extra_stalls(original, every=10**6), seed=10 + s) for s in range(5)]
        slow = runner.evaluate(with_extra_stalls(original), seed=20)
        half = runner.evaluate(with_extra_stalls(original, every=2), seed=21)
    for name, evs in (("original", same), ("one stall", near), ("all stalls", [slow]), ("half stalls", [half])):
        for e in evs:
            print(f"{name:12} {e.status} rel {e.rel:.4f}  {e.cand_us:.3f} vs {e.base_us:.3f} us  load {e.load_s:.4f} "
                  f"test {e.test_s:.4f} time {e.time_s:.4f} round trip {e.wall_s:.4f} s")
    assert all(e.ok for e in same + near + [slow, half])
    assert all(abs(e.rel - 1) < 0.03 for e in same + near)  # noise floor
    assert slow.rel > 1.10 and half.rel > 1.03 and slow.rel > half.rel  # resolves a real difference
    assert sorted(e.wall_s for e in near)[2] < 0.5  # a small kernel's candidate costs < 0.5 s


def test_any_cutedsl_kernel_can_be_evaluated(env):
    factory = demo_workload
    original = factory().kernel.cubin
    with Runner(factory) as runner:
        runner.start()
        base = runner.evaluate(original, seed=1)
        slow = runner.evaluate(with_extra_stalls(original), seed=2)
    print(f"\ndemo kernel: same {base.rel:.4f}, stalled {slow.rel:.4f} ({base.base_us:.3f} us per launch)")
    assert base.ok and slow.ok and abs(base.rel - 1) < 0.03 and slow.rel > base.rel


def test_a_broken_candidate_is_rejected_and_never_cached(env):
    original = QK_DECODE().kernel.cubin
    broken = store_before_its_data(original)
    with Runner(QK_DECODE) as runner:
        ev = runner.evaluate(broken, seed=5)
        val = runner.validate(broken, seed=6, samples=100)
        assert runner.crashes == 0
    print(f"\nbroken candidate: {ev.status}: {ev.detail}; validation: {val}")
    assert ev.status == "incorrect" and math.isinf(ev.rel)
    assert val["status"] == "incorrect" and val["passed"] == 0
    # A search whose every proposal is broken ends with nothing cached. (The broken cubins are made
    # from the original: a few distinct ones, each proposal mapped to one of them.)
    variants = [store_before_its_data(with_extra_stalls(original, every=e)) for e in (10**6, 50, 20)]
    report = tuning.tune(QK_DECODE, tuning.TuneConfig(budget_iters=10, runs=1, samples=100, min_speedup=0.0, retimes=1,
                                                      sanitize=False),
                         kernel="qk_norm", candidate_hook=lambda c: variants[hash(c) % 3])
    print(report.text())
    assert report.evaluated > 0 and report.incorrect == report.evaluated
    assert not report.cached and "nothing cached" in report.outcome
    assert tuned.list_entries(env) == []


def test_crashing_candidates_do_not_stop_the_search(env):
    original = QK_DECODE().kernel.cubin
    crashing = [store_to_null(original), store_to_null(with_extra_stalls(original, every=10**6))]
    proposals = []

    def hook(cubin: bytes) -> bytes:
        proposals.append(cubin)
        return crashing[len(proposals) // 7] if len(proposals) in (3, 7) else cubin

    config = tuning.TuneConfig(budget_iters=14, runs=1, samples=300, min_speedup=0.0, retimes=1, sanitize=False)
    report = tuning.tune(QK_DECODE, config, kernel="qk_norm", candidate_hook=hook)
    print(report.text())
    assert report.iterations == 14 and len(proposals) == 14
    assert report.crashed == 2
    assert report.worker_starts >= 3  # first start, a new worker after a crash, a fresh one for the finals


def test_tune_cache_then_warmup_in_a_fresh_process(env, tmp_path):
    if probe.sanitizer_problem():
        pytest.skip(probe.sanitizer_problem())  # a cubin is stored only once compute-sanitizer ran it
    config = tuning.TuneConfig(budget_iters=60, runs=2, samples=2000, min_speedup=0.0, seed=1)
    shape = workloads.resolve("qk_norm", "decode")[1]
    report = tuning.tune(QK_DECODE, config, kernel="qk_norm", shape=shape)
    print(report.text())
    assert report.cached, report.outcome
    # The A/A pair (the original against a byte-identical copy, 3 fresh workers) is near 1.
    assert 0 <= report.aa_spread < 0.05 and all(len(f["rels"]) == 3 for f in report.finalists)
    workload = QK_DECODE()
    entry = tuned.lookup(None, "qk_norm", workload.kernel.variant, workload.kernel.cubin)
    assert entry is not None and entry.tuned != workload.kernel.cubin
    assert entry.meta["samples_passed"] == 2000 and entry.meta["gpu"] == report.gpu
    assert entry.meta["sanitizer"] == dict.fromkeys(probe.SANITIZER_TOOLS, "clean")  # run before it was stored
    checks = entry.meta["checks"]  # compared at the tuned shape; re-timed through rosekernels.qk_norm
    assert checks["shapes"]["tuned_samples"] == config.shape_samples and checks["shapes"]["tuned"]["tokens"] == 1
    assert checks["op_level"]["op"] == "rosekernels.qk_norm" and entry.speedup == checks["op_level"]["speedup"]
    # 2000 samples (and min_speedup 0): below the store's bar, so the fresh process opts in to load it
    assert "2000 of 2000 samples passed (the bar: all of at least 10000)" in entry.problems
    v = workload.kernel.variant
    script = textwrap.dedent(f"""
        import dataclasses
        import torch
        import cutlass.cute as cute
        from rosekernels import jit
        import rosekernels
        from rosekernels.kernels import qk_norm
        from rosekernels.startup import warmup
        variant = jit.Variant.of({v.op!r}, {v.mode!r}, **{dict(v.params)!r})
        report = warmup([variant], allow_unverified=True)
        print(report)
        assert report.tuned == [variant.key()], report
        config = qk_norm.Config.from_variant(variant)
        kernel = qk_norm.compile(config)
        untuned, swapped = jit.load_object(kernel.object_bytes, {{}})
        assert kernel.tuned and not swapped
        def no_jit(*a, **k):
            raise AssertionError("JIT after warmup")
        cute.compile = no_jit
        for tokens in (1, 2, 3, 5, 6):
            w = qk_norm.workload(config, dataclasses.replace(qk_norm.Shape.defaults("decode"), tokens=tokens))
            assert w.kernel is kernel
            for seed in range(20):
                a = w.make_args(seed)
                b = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in a)
                w.run(kernel.fn, a)
                w.run(untuned, b)
                for x, y in zip(w.outputs(a), w.outputs(b)):
                    assert torch.equal(x.view(torch.int16), y.view(torch.int16)), (tokens, seed)
                w.check(a)
            q, k, wq, wk = a[:4]
            oq, ok = rosekernels.qk_norm(q, k, wq, wk, eps=1e-6)  # the op: served by the tuned kernel
            assert torch.equal(oq.view(torch.int16), w.outputs(b)[0].view(torch.int16))
        torch.cuda.synchronize()
        print("IDENTICAL")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         env={**os.environ, paths.TUNED_STORE_ENV: str(env)})
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0 and "IDENTICAL" in out.stdout


@pytest.mark.parametrize("kernel", ["qk_norm", "attention_decode"])
def test_the_profilers_samples_land_on_the_kernels_instructions(kernel):
    """ncu's PC samples of the original read back onto its disassembly (every listed instruction is
    the kernel's at that offset) and reweight the proposals; attention_decode spends most of its
    samples in its KV loop."""
    factory = workloads.factory(kernel, "decode")
    original = factory().kernel.cubin
    listing = probe.profile(factory, original)
    schedule = tuning.engine_initial(original, "alu")
    weighted, hot = tuning.engine_weighted(schedule, listing)
    samples = profile.stall_samples(listing, schedule.model.kernel)
    print(f"\n{kernel}: {sum(samples)} samples; hottest blocks {hot}")
    assert sum(samples) >= profile.MIN_SAMPLES and weighted.layout.weight != schedule.layout.weight
    if kernel == "attention_decode":
        assert sum(h["share"] for h in hot if h["loop_depth"] > 0) > 0.5
