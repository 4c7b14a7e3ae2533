"""Op-level verification (sip_tune.oplevel). CPU: every kernel's public-op case builds input sets of
the tuned shape, the rotation passes L2, and the fresh process is set up as a user's (its own
tuned store holding the candidate, this process's compile cache, the candidate reached through the
store; qk_norm compiles on the CPU in seconds). GPU: a GEMM config and a qk_norm cubin re-timed
through the public ops (a minute or two in all: each spawns a process that loads the kernels)."""
import dataclasses
import json
import math
import os

import pytest
from store_samples import CONFIG_META

import rosekernels
from rosekernels import contract, paths, tuned
from rosekernels.kernels import KERNELS, kernel_module, qk_norm_plan
from sip.mutate import with_extra_stalls
from sip_tune import oplevel, workloads


def test_the_qk_norm_case_with_rope_passes_the_tables_and_keeps_the_outputs_last(monkeypatch):
    import torch

    shape = qk_norm_plan.QKNormShape(5, 4, 2, 64, "bf16", rope="bf16")
    case = oplevel.CASES["qk_norm"](shape)
    s = case.make_set(1, "cpu")
    assert len(s) == 8 and case.outputs == 2 and tuple(s[-2].shape) == (5, 4, 64) and tuple(s[-1].shape) == (5, 2, 64)
    assert all(t.shape == (5, 64) and t.dtype == torch.bfloat16 for t in s[4:6])
    assert case.input_bytes(s) == sum(t.nbytes for t in s[:6])
    calls = []
    monkeypatch.setattr(rosekernels, "qk_norm", lambda *args, **kwargs: calls.append(kwargs), raising=False)
    case.call(s)
    assert calls[0]["cos"] is s[4] and calls[0]["sin"] is s[5] and calls[0]["out_q"] is s[6]
    with pytest.raises(ImportError, match="rotary"):
        case.peers["quack"]()


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.TUNED_STORE_ENV, str(tmp_path / "sip"))
    tuned.forget_configs()
    yield tmp_path / "sip"
    tuned.forget_configs()


def _shapes():
    """Each kernel's default shape of its first mode."""
    for kernel in sorted(KERNELS):
        m = kernel_module(kernel)
        for mode in ("decode", "prefill"):
            try:
                yield kernel, m.Shape.defaults(mode)
                break
            except ValueError:
                continue


@pytest.mark.parametrize("kernel, shape", list(_shapes()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_kernel_has_a_public_op_case_at_its_shape(kernel, shape):
    import torch

    case = oplevel.CASES[kernel](shape)
    assert case.op.startswith("rosekernels.") and case.op.split(".")[1] in rosekernels.__all__
    a, b = case.make_set(1, "cpu"), case.make_set(2, "cpu")
    tensors = [t for t in a if isinstance(t, torch.Tensor)]
    assert tensors and case.input_bytes(a) == sum(t.nbytes for t in a[:len(a) - case.outputs]
                                                  if isinstance(t, torch.Tensor))
    assert not torch.equal(a[0], b[0])  # every set its own data: a replay cycle reads distinct bytes
    first = {  # the first argument of the op, from the shape's sizes
        "gemm_leakyrelu": lambda s: (s.m, s.k), "qk_norm": lambda s: (s.tokens, s.q_heads, s.head_dim),
        "rmsnorm": lambda s: (s.rows, s.hidden), "moe_dispatch": lambda s: (s.tokens, s.hidden),
        "moe_combine": lambda s: (s.tokens * s.topk, s.hidden),
        "attention": lambda s: (s.batch, s.seqlen, s.heads_q, s.head_dim),
        "attention_decode": lambda s: (s.batch, s.seqlen_q, s.heads_q, s.head_dim),
        "append_kvcache": lambda s: (s.batch * -(-(s.new_tokens + 64) // 16), 16, s.kv_heads, s.head_dim),
        "grouped_gemm": lambda s: (s.rows, s.k), "quantize_fp8": lambda s: (s.rows, s.hidden),
        "gemm_fp8": lambda s: (s.m, s.k), "moe_route": lambda s: (s.tokens, s.experts)}
    assert tuple(a[0].shape) == first[kernel](shape)
    if kernel == "gemm_leakyrelu":
        assert tuple(a[1].shape) == (shape.n, shape.k) and tuple(a[-1].shape) == (shape.m, shape.n)
        assert "cublas+leaky_relu" in case.peers
    if kernel == "grouped_gemm":  # w per expert, offsets a grouping of all rows, out gated
        a, w, offsets, bias, index, scale, out = a
        assert tuple(w.shape) == (shape.experts, shape.n, shape.k) and tuple(out.shape) == (shape.rows, shape.n // 2)
        assert offsets[0] == 0 and offsets[-1] == shape.rows and bool((offsets.diff() >= 0).all())
    if kernel == "append_kvcache":  # every token lands inside its sequence's rows
        k_cache, _, k, _, lengths, table = a
        rows = table.shape[1] * k_cache.shape[1]
        assert int(lengths.max()) + k.shape[1] <= rows and int(lengths.min()) >= 0


@pytest.mark.parametrize("kernel, shape", [(k, s) for k, s in _shapes() if hasattr(s, "pdl")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_case_calls_the_op_with_the_shapes_pdl(kernel, shape, monkeypatch):
    """A shape tuned with pdl=0 is another bucket's: the op must be called with enable_pdl=False, or
    it plans the pdl=True shape and the re-time measures another config than the candidate's."""
    for pdl in (False, True):
        case = oplevel.CASES[kernel](dataclasses.replace(shape, pdl=pdl))
        calls = []
        monkeypatch.setattr(rosekernels, case.op.split(".")[1], lambda *args, **kw: calls.append(kw))
        case.call(tuple(object() for _ in range(8)))  # the op is a stand-in: any arguments do
        assert [kw.get("enable_pdl") for kw in calls] == [pdl]


def test_gemm_cases_follow_the_shapes_options():
    import torch

    from rosekernels.kernels.gemm_leakyrelu_plan import GemmShape

    gated = oplevel.CASES["gemm_leakyrelu"](GemmShape(8, 256, 64, bias="fp32", activation="silu", gated=True,
                                                       b_major="n"))
    a, w, bias, bias_peer, out = gated.make_set(3, "cpu")
    assert gated.op == "rosekernels.gemm" and tuple(w.shape) == (64, 256) and w.is_contiguous()  # [K, N]: "kn"
    assert tuple(out.shape) == (8, 128) and bias.dtype.is_floating_point and bias_peer.dtype == a.dtype
    # the peer computes what the op does: w's rows hold gate and up in alternating blocks of 8
    y = gated.peers["cublas+silu"]()((a.double(), w.double(), None, None, out))
    full = a.double() @ w.double()  # [M, N]
    index = torch.arange(128)
    gate, up = full[:, 16 * (index // 8) + index % 8], full[:, 16 * (index // 8) + 8 + index % 8]
    assert torch.allclose(y, torch.nn.functional.silu(gate) * up)


def test_the_rotation_of_input_sets_passes_l2():
    l2 = 50 << 20
    for set_bytes in (1 << 10, 3 << 20, 40 << 20, 150 << 20, 3 << 30):
        ring = oplevel.ring_sets(set_bytes, l2)
        assert ring >= 2
        if set_bytes * ring <= oplevel.MAX_RING_BYTES:
            assert set_bytes * ring > max(60e6, 2 * l2)
        else:
            assert ring == 2


def qk_candidates():
    """A prefill qk_norm shape (bucket tokens=4096 on 132 SMs), its heuristic and another candidate."""
    shape = qk_norm_plan.QKNormShape(3000)
    heuristic = qk_norm_plan.config_for(shape, 132)
    return shape, heuristic, next(c for c in qk_norm_plan.candidates(shape, 132) if c.variant() != heuristic.variant())


def test_the_fresh_process_reaches_a_config_candidate_through_its_own_store(store):
    from rosekernels.kernels import qk_norm

    shape, heuristic, other = qk_candidates()
    original = qk_norm.compile(heuristic).cubin_sha256
    setup = oplevel.check_setup("qk_norm", shape, oplevel.ConfigCandidate(other, heuristic, original))
    assert setup["reached"], setup
    assert setup["store"] != str(store) and "sip-oplevel-" in setup["store"]  # never the user's store
    assert setup["compile_cache"] == str(paths.compile_cache_root()) and setup["allow_env"] is None
    assert tuned.config_entries(store, qk_norm) == []  # nothing written to the real store
    # a candidate tuned against another heuristic than the op picks at the shape is not reached
    wrong = oplevel.check_setup("qk_norm", shape, oplevel.ConfigCandidate(other, other, original))
    assert not wrong["reached"] and "heuristic" in wrong["problem"]
    stale = oplevel.check_setup("qk_norm", shape, oplevel.ConfigCandidate(other, heuristic, "ab" * 32))
    assert not stale["reached"] and "not the candidate" in stale["problem"]


def test_the_fresh_process_installs_a_cubin_candidate_as_warmup_does(store):
    w = workloads.build("qk_norm", "decode", {"tokens": 2})
    candidate = oplevel.CubinCandidate(w.kernel.variant, w.kernel.cubin, with_extra_stalls(w.kernel.cubin))
    setup = oplevel.check_setup("qk_norm", qk_norm_plan.QKNormShape(2), candidate)
    assert setup["reached"], setup
    tampered = bytearray(candidate.tuned)
    tampered[0x18] ^= 1  # the ELF header: the store refuses it before any process starts
    with pytest.raises(tuned.CacheError, match="the ELF header"):
        oplevel.check_setup("qk_norm", qk_norm_plan.QKNormShape(2),
                            dataclasses.replace(candidate, tuned=bytes(tampered)))


def test_a_cubin_candidate_sees_only_the_verified_config_entries(store, tmp_path):
    """The op reaches a tuned cubin's config through the store's config entries, as a user's op would:
    those below the bar (a user's op ignores them) stay out of the process's store."""
    shape, heuristic, other = qk_candidates()
    qk_norm = kernel_module("qk_norm")
    verified, _ = tuned.store_config(store, qk_norm, shape, other, heuristic, "ab" * 32, CONFIG_META)
    big = dataclasses.replace(shape, tokens=9000)
    tuned.store_config(store, qk_norm, big, other, qk_norm_plan.config_for(big, 132), "cd" * 32, {"speedup": 2.0})
    w = workloads.build("qk_norm", "decode", {"tokens": 2})
    work = tmp_path / "work"
    oplevel.prepare("qk_norm", shape, oplevel.CubinCandidate(w.kernel.variant, w.kernel.cubin,
                                                             with_extra_stalls(w.kernel.cubin)), work, store)
    copied = sorted(p.name for p in (work / "store").rglob("*.json") if p.parent.name == tuned.CONFIGS_DIR)
    assert copied == [verified.name]
    assert list((work / "store").rglob("tuned.cubin"))
    env = oplevel.child_env(work)
    assert env[paths.TUNED_STORE_ENV] == str(work / "store") and env[tuned.ALLOW_ENV] is None
    assert env[paths.COMPILE_CACHE_ENV] == str(paths.compile_cache_root())


def test_a_kernel_without_a_case_is_an_error_not_a_measurement():
    timing = oplevel.retime("nope", qk_norm_plan.QKNormShape(1), oplevel.ConfigCandidate(None, None, ""))
    assert timing.error and not timing.passes(0.0) and "no op-level case" in timing.text()


def test_op_timing_passes_only_past_the_bar_and_its_a_a_spread():
    t = oplevel.OpTiming("k", speedup=1.03, aa_spread=0.02)
    assert t.passes(1.01) and not t.passes(1.05)
    assert not dataclasses.replace(t, aa_spread=0.04).passes(1.0)
    assert not dataclasses.replace(t, error="crashed").passes(0.0)
    meta = t.meta()
    assert meta["speedup"] == 1.03 and "kernel" not in meta and json.dumps(meta)


# ---------------------------------------------------------------------------------------------
# On the GPU

@pytest.mark.gpu
def test_a_gemm_config_is_retimed_through_the_public_op_against_cublas(store):
    """M = 8, 4096 x 4096 decode: the heuristic against another candidate (a different tile), and the
    cuBLAS peer, in one fresh process."""
    from rosekernels.kernels import gemm_leakyrelu
    from rosekernels.kernels.gemm_leakyrelu_plan import GemmShape

    shape = GemmShape(8, 4096, 4096)
    heuristic = gemm_leakyrelu.config_for(shape)
    other = next(c for c in gemm_leakyrelu.candidates(shape) if c.variant() != heuristic.variant())
    gemm_leakyrelu.compile(other)
    timing = oplevel.retime("gemm_leakyrelu", shape, oplevel.ConfigCandidate(
        other, heuristic, gemm_leakyrelu.compile(heuristic).cubin_sha256), rounds=20)
    print(timing.text())
    assert not timing.error, timing.error
    assert timing.op == "rosekernels.gemm_leakyrelu" and timing.candidate == "config"
    assert timing.bytes_per_cycle > 60e6 and timing.launches_per_graph >= timing.input_sets >= 2
    assert 0 <= timing.aa_spread < 0.05 and timing.heuristic_us > 0 and timing.tuned_us > 0
    assert timing.speedup == pytest.approx(timing.heuristic_us / timing.tuned_us, rel=0.1)
    assert timing.peer == "cublas+leaky_relu" and math.isfinite(timing.vs_peer) and timing.peer_us > 0


@pytest.mark.gpu
def test_a_config_tuned_without_pdl_is_retimed_as_the_op_plans_it(store):
    """attention_decode at pdl=0 (batch 1, S_kv 4096: the heuristic splits in 16): the op called with
    enable_pdl=False plans the candidate's bucket, and the fresh process checks that the op compiles
    the heuristic, then the candidate (another split count), before it times them."""
    from rosekernels.kernels import attention_decode
    from rosekernels.kernels.attention_decode_plan import DecodeShape

    shape = DecodeShape(batch=1, seqlen_kv=4096, pdl=False)
    heuristic = attention_decode.config_for(shape)
    other = next(c for c in attention_decode.candidates(shape) if c.splits != heuristic.splits)
    assert not heuristic.pdl and not other.pdl
    timing = oplevel.retime("attention_decode", shape, oplevel.ConfigCandidate(
        other, heuristic, attention_decode.compile(heuristic).cubin_sha256), rounds=5)
    print(timing.text())
    assert not timing.error, timing.error
    assert timing.op == "rosekernels.attention" and timing.tuned_us > 0 and timing.heuristic_us > 0


@pytest.mark.gpu
def test_a_stalled_cubin_measures_slower_through_the_op(store):
    """The qk_norm decode cubin with every stall raised: the op must load it (the tuned-cubin path)
    and measure it slower than the original; a cubin of a variant the op does not plan is an error."""
    w = workloads.build("qk_norm", "decode", {"tokens": 4})
    slow = oplevel.CubinCandidate(w.kernel.variant, w.kernel.cubin, with_extra_stalls(w.kernel.cubin))
    timing = oplevel.retime("qk_norm", qk_norm_plan.QKNormShape(4), slow, rounds=20)
    print(timing.text())
    assert not timing.error, timing.error
    assert timing.candidate == "cubin" and timing.speedup < 0.97 and not timing.passes(0.0)
    elsewhere = oplevel.retime("qk_norm", contract.shape_with(qk_norm_plan.QKNormShape(3000), {}), slow, rounds=5)
    assert "does not launch" in elsewhere.error
    assert os.environ.get(tuned.ALLOW_ENV) is None
