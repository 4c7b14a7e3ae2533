"""MoE across GPUs (rosekernels.moe): the peer kernels compile for sm_90a with the release/acquire
protocol in their SASS (on every path, every data store reaches the flag that publishes it through a
CTA barrier and a system-scope release on the flag's thread; builds without that release across GPUs
fail the check, the build without the redundant per-thread fences passes it) and spin with a sleep,
the error word and the clock read every few polls (CPU); the layout every rank's object must agree
on, refused on every rank when they do not, and the arena claimed only by a construction that
succeeded (CPU, the collective stubbed); on one GPU, ranks emulated on streams (SymmetricMemory
refuses two ranks on one device) against single-GPU references: expert parallel bitwise equal to one
GPU's dispatch + combine of the same expert rows (random, dropped, skewed and invalid routings, ragged
batches, T up to 8192, bf16/fp16), tensor parallel within the float64 bound and bitwise equal across
ranks, many steps in a row and CUDA-graph replays, the step counter across 2^31 and 2^32, a combine
that ends only after every returned row was flagged; failures that end in bounded time with a raise on
every rank (a peer that never signals, a skipped call, a rank asleep past the timeout, tensor-parallel
token counts that disagree, a flag too far ahead, inside graphs too, ranks built with other experts);
one object per arena, the step kept with the arena, an arena left mid-step refused, one stream per
object. The same protocol on two GPUs: tests/kernels/test_moe_multigpu.py (torchrun)."""
import dataclasses
import gc
import re
import time
import types

import pytest
import torch

from kernel_sass import sass_of
import rosekernels
from rosekernels import moe
from rosekernels.kernels import moe_combine as mc
from rosekernels.kernels import moe_peer as mp
from sip import SipError
from sip import cfg as sip_cfg
from sip import sass as sip_sass
from sip.cubin import parse_cubin

BF16, FP16 = torch.bfloat16, torch.float16


# ---------------------------------------------------------------------------------------------
# CPU

CONFIGS = [mp.PeerConfig("ep_send", 2, "bf16", 7168, 8, 128), mp.PeerConfig("ep_send", 4, "fp16", 2048, 6, 16),
           mp.PeerConfig("ep_return", 2, "bf16", 7168, 8, 128), mp.PeerConfig("ep_return", 8, "fp16", 2880, 1, 4),
           mp.PeerConfig("wait", 2, region=mp.EP_FLAG), mp.PeerConfig("wait", 8, region=mp.EP_RFLAG, bump=True),
           mp.PeerConfig("tp_reduce", 2, "bf16", 2048, 0), mp.PeerConfig("tp_reduce", 2, "bf16", 2048, 8),
           mp.PeerConfig("tp_reduce", 4, "fp16", 2880, 6, weight_dtype="fp16")]


def _disassemble(kernel):
    """(instructions, blocks, successors) of the kernel's SASS; None without nvdisasm."""
    try:
        (k,) = sip_sass.disassemble(parse_cubin(kernel.cubin)).values()
    except SipError:
        return None
    assert not any(i.base == "CALL" for i in k.instructions), "a call: the path checks do not follow calls"
    return k.instructions, k.blocks, sip_cfg.successors(k)


def _predicate_register(predicate: str) -> int:
    """The register id (sip.sass) of an instruction predicate such as "@!P0" or "@UP1"."""
    uniform, number = re.fullmatch(r"@!?(U?)P(\d)", predicate).groups()
    return (sip_sass.UP_BASE if uniform else sip_sass.P_BASE) + int(number)


def release_paths(kernel) -> tuple[list[str], int] | None:
    """(violations, flag stores) in the kernel's SASS; None without nvdisasm. A flag store is an
    STG.STRONG (st.release or st.relaxed at a scope), a data store any weak STG. What the PTX memory
    model needs for a peer that acquires a flag to see the data stores of every thread of the CTA
    (rosekernels/kernels/moe_peer.py): on every path from a data store to a flag store, a CTA barrier
    (the stores of every thread before it precede what the flag thread does after it), then, after
    that barrier, a MEMBAR.*.SYS on the flag thread (the release: unpredicated, or under the flag
    store's own predicate, not rewritten in between); and every flag store system-scope. A fence
    before the barrier counts for nothing here: it orders only its own thread's stores."""
    got = _disassemble(kernel)
    if got is None:
        return None
    ins, blocks, succ = got
    flag = [i.base == "STG" and "STRONG" in i.modifiers for i in ins]
    data = [i.base == "STG" and "STRONG" not in i.modifiers for i in ins]
    sys_fence = [i.base == "MEMBAR" and "SYS" in i.modifiers for i in ins]
    always = [i.predicate in ("", "@PT") for i in ins]

    def run(b: int, state: tuple[bool, bool], violations: list[str]) -> tuple[bool, bool]:
        """state: (a data store since the last barrier, a data store before a barrier not yet fenced)."""
        unbarred, unfenced = state
        guard = None  # a predicated fence's predicate: it covers a flag store under the same one
        for i in blocks[b]:
            if guard is not None and _predicate_register(guard) in ins[i].writes:
                guard = None
            if data[i]:
                unbarred = True
            elif ins[i].base == "BAR" and always[i]:
                unfenced, unbarred = unfenced or unbarred, False
            elif sys_fence[i]:
                if always[i]:
                    unfenced = False
                else:
                    guard = ins[i].predicate
            elif flag[i]:
                where = f"{ins[i].offset:#06x} {ins[i].text}"
                if unbarred:
                    violations.append(f"{where} after a data store with no CTA barrier between")
                if unfenced and (always[i] or ins[i].predicate != guard):
                    violations.append(f"{where}: no system-scope fence on its thread after the barrier")
                if "SYS" not in ins[i].modifiers:
                    violations.append(f"{where} is not system-scope")
        return unbarred, unfenced

    state_in = [(False, False)] * len(blocks)
    work = list(range(len(blocks)))
    while work:
        b = work.pop()
        out = run(b, state_in[b], [])
        for s in succ[b]:
            merged = (state_in[s][0] or out[0], state_in[s][1] or out[1])
            if merged != state_in[s]:
                state_in[s] = merged
                work.append(s)
    violations: list[str] = []
    for b in range(len(blocks)):
        run(b, state_in[b], violations)
    return violations, sum(flag)


def spin_loops(kernel) -> list[tuple[int, bool, bool]] | None:
    """For each block in a cycle that polls a flag (an unconditional LDG...STRONG.SYS): (its offset,
    whether every cycle through it sleeps (NANOSLEEP), whether some cycle through it reads no other
    system-scope word and not the clock (SR_GLOBALTIMER) unconditionally: the error word and the
    deadline checked every few polls, not on every one). None without nvdisasm."""
    got = _disassemble(kernel)
    if got is None:
        return None
    ins, blocks, succ = got
    always = [i.predicate in ("", "@PT") for i in ins]
    poll = [i.base == "LDG" and {"STRONG", "SYS"} <= set(i.modifiers) and always[j] for j, i in enumerate(ins)]
    clock = [any("SR_GLOBALTIMER" in o for o in i.operands) and always[j] for j, i in enumerate(ins)]
    sleeps = [i.base == "NANOSLEEP" for i in ins]

    def returns(b: int, avoid) -> bool:
        """Whether control can leave b and come back to it through blocks none of which `avoid` holds."""
        seen, todo = set(), list(succ[b])
        while todo:
            c = todo.pop()
            if c == b:
                return True
            if c in seen or any(avoid[i] for i in blocks[c]):
                continue
            seen.add(c)
            todo += succ[c]
        return False

    loops = []
    for b, rng in enumerate(blocks):
        if any(poll[i] for i in rng) and returns(b, [False] * len(ins)):
            sleep_always = any(sleeps[i] for i in rng) or not returns(b, sleeps)
            light = sum(poll[i] for i in rng) == 1 and not any(clock[i] for i in rng) and returns(
                b, [p or c for p, c in zip(poll, clock)])
            loops.append((ins[rng[0]].offset, sleep_always, light))
    return loops


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.variant().key())
def test_peer_kernels_compile_with_the_flag_protocol(fresh_cache, tmp_path, cfg):
    kernel = mp.compile(cfg)
    sass = sass_of(kernel, tmp_path)
    if sass is None:
        return
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory (spills)"
    violations, flags = release_paths(kernel)
    assert not violations, violations
    assert flags == (0 if cfg.op == "wait" else 1), "one 64-bit release store of the flags"
    if cfg.op != "wait":
        assert re.search(r"STG\.E\.64\.STRONG\.SYS", sass)
        assert re.search(r"LDG\.E\.\S*128", sass)
    if cfg.op in ("wait", "tp_reduce"):
        assert "LDG.E.64.STRONG.SYS" in sass and "SR_GLOBALTIMER" in sass, "a wait without a deadline"
        # a failed wait reaches every rank's error word
        assert sass.count("ATOMG.E.CAS.64.STRONG.SYS") == cfg.world
        # the spin: a sleep between polls; the error word and the clock not on every poll
        loops = spin_loops(kernel)
        assert loops and all(sleeps and light for _, sleeps, light in loops), loops


@pytest.mark.parametrize("op", ["ep_send", "ep_return", "tp_reduce"])
def test_builds_without_the_per_thread_fences_still_release_every_store(fresh_cache, op):
    """fence="none": the barrier, then the flag thread's system-scope release: what the memory model
    asks for (moe_peer's docstring), so the check passes it; only the per-thread fences are gone."""
    base = {c.op: c for c in CONFIGS}[op]
    got = release_paths(mp.compile(dataclasses.replace(base, fence="none")))
    if got is None:
        return
    assert got == ([], 1)


@pytest.mark.parametrize("op", ["ep_send", "ep_return", "tp_reduce"])
@pytest.mark.parametrize("fence", ["gpu", "relaxed"])
def test_the_release_check_fails_builds_that_do_not_release_across_gpus(fresh_cache, op, fence):
    """Fences and flags scoped to one GPU; or the flag stored relaxed with no fence on its thread."""
    base = {c.op: c for c in CONFIGS}[op]
    got = release_paths(mp.compile(dataclasses.replace(base, fence=fence)))
    if got is None:
        return
    violations, flags = got
    assert flags == 1 and any("no system-scope fence" in v for v in violations), violations
    assert any("not system-scope" in v for v in violations) == (fence == "gpu")


@pytest.mark.parametrize("op", ["ep_send", "ep_return"])
def test_row_copies_issue_their_loads_before_their_stores(fresh_cache, tmp_path, op):
    """DeepSeek-V3 widths (896 vectors a row: one chunk, UNROLL vectors a thread): each copy issues
    its UNROLL 16-byte loads back to back, then its stores; ep_send reads the row once for both ranks."""
    cfg = mp.PeerConfig(op, 2, "bf16", 7168, 8, 128)
    sass = sass_of(mp.compile(cfg), tmp_path)
    if sass is None:
        return
    order = "".join(m[0] for m in re.findall(r"\b(LDG|STG)\.E[.\w]*128\b", sass))
    if op == "ep_send":
        assert order == "L" * mp.UNROLL + "S" * mp.UNROLL * cfg.world
    else:  # one copy per owned pair
        assert order == ("L" * mp.UNROLL + "S" * mp.UNROLL) * cfg.topk


def test_peer_config_refuses_bad_sizes():
    with pytest.raises(ValueError, match="world"):
        mp.PeerConfig("wait", 0)
    with pytest.raises(ValueError, match="16 bytes"):
        mp.PeerConfig("ep_send", 2, "bf16", 100, 8, 4)
    with pytest.raises(ValueError, match="no peer kernel"):
        mp.PeerConfig("gather", 2)
    with pytest.raises(ValueError, match="fence"):
        mp.PeerConfig("wait", 2, fence="cta")


@pytest.mark.parametrize("cls", [moe.ExpertParallel, moe.TensorParallel])
def test_arena_regions_are_aligned_and_disjoint(cls):
    sizes = cls.regions(2, 7168, 128, 8, BF16)
    offsets, total = moe._layout(sizes)
    assert offsets[mp.STATE] == 0 and sizes[mp.STATE] == mp.STATE_BYTES  # the same place in every layout
    assert all(o % moe.ALIGN == 0 for o in offsets) and total % moe.ALIGN == 0
    assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(sizes) - 1))
    assert offsets[-1] + sizes[-1] <= total
    for region in cls.FLAG_REGIONS:  # 64-bit flags
        assert sizes[region] % mp.FLAG_BYTES == 0 and offsets[region] % mp.FLAG_BYTES == 0


@pytest.mark.parametrize("kw,error", [
    (dict(dtype="bf16"), TypeError), (dict(max_tokens=None), ValueError), (dict(world=33), ValueError),
    (dict(topk=65), ValueError), (dict(hidden=100), ValueError), (dict(timeout_ms=0), ValueError),
    (dict(weight_dtype=torch.float16), TypeError), (dict(max_tokens=moe.MAX_TOKENS + 1), ValueError),
    (dict(max_tokens=2**23, hidden=2048), ValueError)])  # 2^31 vectors: tp_reduce's index would wrap
def test_constructor_arguments_are_checked_before_anything_is_allocated(kw, error):
    args = dict(world=2, num_experts=16, hidden=256, max_tokens=8, topk=2, dtype=BF16, weight_dtype=torch.float32,
                timeout_ms=100)
    args.update(kw)
    with pytest.raises(error):
        moe._check_args(*args.values())


def _cpu_peers(rank=0, world=2, bases=None, nbytes=1024, group=object()):
    """Peers over a CPU arena (a group stands in for the process group: no stream, no device query)."""
    arena = torch.zeros(nbytes, dtype=torch.uint8)
    if bases is None:
        bases = [arena.data_ptr() + (r - rank) * (1 << 20) for r in range(world)]
    return moe.Peers(rank, world, arena, bases, group=group, sms=1)


def test_peers_assert_their_address_translation():
    own = _cpu_peers(rank=1)
    assert own.bases[1] == own.arena.data_ptr()
    with pytest.raises(ValueError, match="address translation"):  # bases[rank] is not the arena
        _cpu_peers(bases=[own.arena.data_ptr() + 256, own.arena.data_ptr()])
    with pytest.raises(ValueError, match="arena addresses"):
        _cpu_peers(world=3, bases=[0, 0])
    arena = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16-byte"):
        moe.Peers(0, 2, arena, [arena.data_ptr(), arena.data_ptr() + 4104], group=object(), sms=1)


class _Owner:
    _failed = ""


_EP_KEY = moe.ExpertParallel.layout_key(2, 32, 1024, 64, 4, BF16, torch.float32, 132)
_TP_KEY = moe.TensorParallel.layout_key(2, 32, 1024, 64, 4, BF16, torch.float32, 132)


def _exchanging(peers, *others):
    """`peers` whose collective returns its own row and the given rows of the other ranks (by rank)."""
    def exchange(row):
        rows = list(others)
        rows.insert(peers.rank, row)
        return rows

    peers._exchange = exchange
    return peers


def test_one_live_object_per_arena_and_one_layout():
    peers = _exchanging(_cpu_peers(), [0, *_EP_KEY])
    first = _Owner()
    peers.claim(first, _EP_KEY)
    with pytest.raises(ValueError, match="in use by a live _Owner"):
        peers.claim(_Owner(), _EP_KEY)
    del first
    gc.collect()
    peers.claim(_Owner(), _EP_KEY)  # the first is gone: a second of the same layout continues its step
    gc.collect()
    with pytest.raises(ValueError, match="another layout"):
        peers.claim(_Owner(), _TP_KEY)
    peers.arena[mp.ERROR_OFFSET] = 1  # an earlier step's error
    with pytest.raises(RuntimeError, match="holds the error of an earlier step"):
        peers.claim(_Owner(), _EP_KEY)


def test_an_arena_left_mid_step_refuses_a_new_object():
    """An object dropped between its dispatch and combine (say, an exception between them): a new one
    of the same layout would publish the abandoned step's number again, so the claim refuses."""
    peers = _exchanging(_cpu_peers(), [0, *_EP_KEY])
    first = _Owner()
    peers.claim(first, _EP_KEY)
    peers._mid_step = True  # what ExpertParallel.dispatch leaves until its combine
    del first
    gc.collect()
    with pytest.raises(RuntimeError, match="rank 0's arena was left mid-step .*build new Peers"):
        peers.claim(_Owner(), _EP_KEY)
    assert peers._owner() is None


@pytest.mark.parametrize("field", range(len(moe.LAYOUT_FIELDS)), ids=lambda i: moe.LAYOUT_FIELDS[i])
def test_ranks_whose_objects_disagree_refuse_on_every_rank(field):
    """Each rank's claim sees every rank's layout (the all_gather, stubbed): one field apart, both
    ranks refuse, naming it and both values, and neither arena is claimed."""
    other = list(_EP_KEY)
    other[field] = 1 - other[field] if field == 0 else other[field] + 1  # (form: the other one)
    keys = [_EP_KEY, tuple(other)]
    for rank in range(2):
        peers = _exchanging(_cpu_peers(rank), [0, *keys[1 - rank]])
        with pytest.raises(ValueError, match=rf"disagree on {moe.LAYOUT_FIELDS[field]} \(rank 0: .+, rank 1: .+\)"):
            peers.claim(_Owner(), keys[rank])
        assert peers._owner is None and peers._layout is None


def test_keys_differ_in_every_argument_the_ranks_must_share():
    base = dict(world=2, num_experts=32, hidden=1024, max_tokens=64, topk=4, dtype=BF16, weight_dtype=torch.float32,
                sms=132)
    key = moe.ExpertParallel.layout_key(**base)
    assert len(key) == len(moe.LAYOUT_FIELDS) and key != _TP_KEY
    for name, value in (("num_experts", 16), ("hidden", 2048), ("max_tokens", 32), ("topk", 8), ("dtype", FP16),
                        ("weight_dtype", BF16), ("sms", 78), ("world", 4)):
        changed = moe.ExpertParallel.layout_key(**{**base, name: value})
        assert changed[moe.LAYOUT_FIELDS.index(name)] != key[moe.LAYOUT_FIELDS.index(name)], name
    assert "num_experts (rank 0: 32, rank 1: 16)" in str(moe._refusal(
        [[0, *key], [0, *moe.ExpertParallel.layout_key(**{**base, "num_experts": 16})]]))
    assert "dtype (rank 0: bfloat16, rank 1: float16)" in str(moe._refusal(
        [[0, *key], [0, *moe.ExpertParallel.layout_key(**{**base, "dtype": FP16})]]))


def test_a_rank_whose_arena_cannot_serve_refuses_every_rank():
    for code, error, match in ((moe.IN_USE, ValueError, "rank 1's arena is in use"),
                               (moe.OTHER_LAYOUT, ValueError, "rank 1's arena served an object of another layout"),
                               (moe.HOLDS_ERROR, RuntimeError, "rank 1's arena holds the error"),
                               (moe.MID_STEP, RuntimeError, "rank 1's arena was left mid-step")):
        peers = _exchanging(_cpu_peers(0), [code, *_EP_KEY])
        with pytest.raises(error, match=match):
            peers.claim(_Owner(), _EP_KEY)
        assert peers._owner is None


def test_emulated_ranks_compare_with_the_live_objects_of_the_others(monkeypatch):
    """No process group: rank 1's claim compares with rank 0's live object, refuses, and marks it
    failed (its next call raises); a rank without a live object is not compared."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    ranks = [_cpu_peers(r, group=None) for r in range(2)]
    for p in ranks:
        p._siblings = ranks
    first = _Owner()
    ranks[0].claim(first, _EP_KEY)
    other = list(_EP_KEY)
    other[moe.LAYOUT_FIELDS.index("num_experts")] = 16
    with pytest.raises(ValueError, match=r"disagree on num_experts \(rank 0: 32, rank 1: 16\)"):
        ranks[1].claim(_Owner(), tuple(other))
    assert "disagree on num_experts" in first._failed and ranks[1]._owner is None
    del first
    gc.collect()
    ranks[1].claim(_Owner(), tuple(other))  # rank 0's object is gone: nothing to compare with


def _stub_construction(monkeypatch, preload):
    """ExpertParallel built on the CPU: no device check, no kernels, `preload` instead of _preload."""
    monkeypatch.setattr(moe, "check_sm90", lambda device: None)
    monkeypatch.setattr(moe._Parallel, "_kernel", lambda self, op, **params: None)
    monkeypatch.setattr(moe.ExpertParallel, "_preload", preload)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_a_failed_construction_leaves_the_arena_unclaimed(monkeypatch):
    def fail(self):
        raise RuntimeError("no kernel")

    _stub_construction(monkeypatch, fail)
    peers = _exchanging(_cpu_peers(nbytes=1 << 16), [0, *moe.TensorParallel.layout_key(2, 8, 256, 8, 2, BF16,
                                                                                         torch.float32, 1)])
    with pytest.raises(RuntimeError, match="no kernel"):
        moe.ExpertParallel(16, 256, 8, 2, peers=peers)
    assert peers._owner is None and peers._layout is None
    _stub_construction(monkeypatch, moe._Parallel._preloaded)
    tp_key = moe.TensorParallel.layout_key(2, 8, 256, 8, 2, BF16, torch.float32, 1)
    peers.claim(_Owner(), tp_key)  # another layout: the arena served nothing yet
    assert peers._layout == tp_key


def test_construction_claims_the_arena_once_every_rank_agrees(monkeypatch):
    """Both ranks built with the layout key every rank exchanges: equal keys claim, a rank built with
    other experts refuses on both (each rank's collective stubbed with the other's row)."""
    _stub_construction(monkeypatch, moe._Parallel._preloaded)
    key = [0, *moe.ExpertParallel.layout_key(2, 16, 256, 8, 2, BF16, torch.float32, 1)]
    ranks = [moe.ExpertParallel(16, 256, 8, 2, peers=_exchanging(_cpu_peers(r, nbytes=1 << 16), key)) for r in range(2)]
    assert all(ep.peers._owner() is ep for ep in ranks)
    other = [0, *moe.ExpertParallel.layout_key(2, 32, 256, 8, 2, BF16, torch.float32, 1)]
    for rank, (mine, theirs) in enumerate(((16, other), (32, key))):
        peers = _exchanging(_cpu_peers(rank, nbytes=1 << 16), theirs)
        with pytest.raises(ValueError, match=r"disagree on num_experts \(rank 0: (16|32), rank 1: (32|16)\)"):
            moe.ExpertParallel(mine, 256, 8, 2, peers=peers)
        assert peers._owner is None


def test_combine_refuses_an_out_overlapping_an_input_before_any_launch(monkeypatch):
    """Both forms on CPU tensors (the device checks passed): an out that overlaps what the step's kernels
    still read raises before the call enters its step."""
    _stub_construction(monkeypatch, moe._Parallel._preloaded)
    monkeypatch.setattr(moe.TensorParallel, "_preload", moe._Parallel._preloaded)
    monkeypatch.setattr(moe.checks, "check_cuda", lambda name, t: None)

    def no_step(self):
        raise AssertionError("entered the step")

    monkeypatch.setattr(moe._Parallel, "_enter", no_step)
    T, H, k = 4, 256, 2
    tp_key = [0, *moe.TensorParallel.layout_key(2, 16, H, 8, k, BF16, torch.float32, 1)]
    tp = moe.TensorParallel(16, H, 8, k, peers=_exchanging(_cpu_peers(nbytes=1 << 16), tp_key))
    rows = torch.zeros(16, H, dtype=BF16)
    w, slots = torch.rand(T, k), torch.zeros(T, k, dtype=torch.int32)
    with pytest.raises(ValueError, match="out must not overlap expert_out"):  # the fused decode path's race
        tp.combine(rows, w, slots, out=rows[8:8 + T])
    out = torch.zeros(T, H, dtype=BF16)
    with pytest.raises(ValueError, match="out must not overlap slot_map"):
        tp.combine(rows, w, out.view(torch.int32)[:, :k], out=out)

    ep_key = [0, *moe.ExpertParallel.layout_key(2, 16, H, 8, k, BF16, torch.float32, 1)]
    ep = moe.ExpertParallel(16, H, 8, k, peers=_exchanging(_cpu_peers(nbytes=1 << 16), ep_key))
    ep.peers._mid_step, ep._tokens, ep._weights = True, T, out.view(torch.float32)[:, :k]  # as a dispatch leaves
    ep._received = types.SimpleNamespace(buffer=rows)
    with pytest.raises(ValueError, match="out must not overlap topk_weights"):  # moe_combine's, after the step
        ep.combine(rows, out=out)


def _cpu_forms(monkeypatch, H=256, k=2):
    """A TensorParallel and an ExpertParallel on CPU arenas (the device checks passed, no kernels)."""
    _stub_construction(monkeypatch, moe._Parallel._preloaded)
    monkeypatch.setattr(moe.TensorParallel, "_preload", moe._Parallel._preloaded)
    monkeypatch.setattr(moe.checks, "check_cuda", lambda name, t: None)
    tp_key = [0, *moe.TensorParallel.layout_key(2, 16, H, 8, k, BF16, torch.float32, 1)]
    ep_key = [0, *moe.ExpertParallel.layout_key(2, 16, H, 8, k, BF16, torch.float32, 1)]
    return (moe.TensorParallel(16, H, 8, k, peers=_exchanging(_cpu_peers(nbytes=1 << 16), tp_key)),
            moe.ExpertParallel(16, H, 8, k, peers=_exchanging(_cpu_peers(nbytes=1 << 16), ep_key)))


def test_all_reduce_takes_x_itself_as_out_and_refuses_an_out_partly_over_x(monkeypatch):
    """tp_reduce reads each 16-byte vector of x and later writes the same vector of out, on the same thread: out
    may be x itself (in place) or rows that interleave with x's, but an out a row off x would overwrite vectors
    other CTAs have yet to read: refused before the call enters its step (CPU tensors)."""
    tp, _ = _cpu_forms(monkeypatch)

    def no_step(self):
        raise AssertionError("entered the step")

    monkeypatch.setattr(moe._Parallel, "_enter", no_step)
    rows, wide = torch.zeros(8, 256, dtype=BF16), torch.zeros(4, 512, dtype=BF16)
    x = rows[:4]
    for out in (x, rows[:4], wide[:, 256:]):
        with pytest.raises(AssertionError, match="entered the step"):
            tp.all_reduce(wide[:, :256] if out is wide[:, 256:] else x, out)
    for out in (rows[1:5], rows[3:7]):
        with pytest.raises(ValueError, match="out must not overlap x"):
            tp.all_reduce(x, out)


def test_combines_check_the_pointers_of_a_given_out_only(monkeypatch):
    """An out a combine allocates is aligned and overlaps nothing: the pointer checks a given out takes on every
    call (host time on every decode step) skip it, its address never read on the host once moe_combine planned
    the signature (CPU tensors, the launches stubbed)."""
    from rosekernels import launch
    from rosekernels.ops import moe_combine as combine_op

    tp, ep = _cpu_forms(monkeypatch)
    monkeypatch.setattr(moe._Parallel, "_enter", lambda self: None)
    monkeypatch.setattr(launch, "on_device", lambda device, fn, *args: None)
    monkeypatch.setattr(mc, "compile", lambda cfg: types.SimpleNamespace(fn=lambda *args: None))
    monkeypatch.setattr(combine_op, "check_sm90", lambda device: None)
    monkeypatch.setattr(combine_op, "_plans", launch.PlanCache())
    T, k = 4, 2
    rows, w, slots = torch.zeros(16, 256, dtype=BF16), torch.rand(T, k), torch.zeros(T, k, dtype=torch.int32)
    ep._received = types.SimpleNamespace(buffer=rows, slot_map=slots)
    read, address = [], torch.Tensor.data_ptr
    monkeypatch.setattr(torch.Tensor, "data_ptr", lambda t: read.append(address(t)) or address(t))
    for _ in range(2):  # the first plans moe_combine's signature, validating every argument once
        read.clear()
        ep.peers._mid_step, ep._tokens, ep._weights = True, T, w  # as a dispatch leaves them
        outs = [tp.combine(rows, w, slots), ep.combine(rows)]
    assert [o.shape for o in outs] == [(T, 256)] * 2 and not {address(o) for o in outs} & set(read)


def test_without_a_process_group_construction_says_how():
    with pytest.raises(RuntimeError, match="init_process_group"):
        moe.ExpertParallel(8, 256, 16, 2)


# ---------------------------------------------------------------------------------------------
# GPU: emulated ranks

def _routing(tokens, num_experts, topk, gen, drop=0.05, only=None):
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.long)
    if only is not None:  # every token to the experts `only` (a range)
        ids = only[0] + torch.stack([torch.randperm(only[1], generator=gen)[:topk] for _ in range(tokens)])
    ids[torch.rand(ids.shape, generator=gen) < drop] = -1
    w = torch.rand(tokens, topk, generator=gen).softmax(-1)
    return ids.to(torch.int32).cuda(), w.cuda()


def _scale(num_experts, dtype):
    return (torch.arange(num_experts, dtype=torch.float32, device="cuda") / num_experts + 0.5).to(dtype)


def _experts_apply(got, first, scale):
    """A row-wise 'expert' on the device (graph-capturable): row * scale[its expert]."""
    rows = got.buffer.shape[0]
    local = torch.searchsorted(got.offsets[1:], torch.arange(rows, device="cuda", dtype=torch.int32), right=True)
    local = local.clamp(max=got.counts.shape[0] - 1)
    return got.buffer * scale[first + local][:, None]


def _single_gpu(x, ids, w, scale):
    """What one GPU's dispatch + the same expert + combine give: each pair's row x[t] * scale[e]."""
    tokens, topk = ids.shape
    valid = (ids >= 0) & (ids < scale.shape[0])
    rows = (x[:, None, :] * scale[ids.clamp(0, scale.shape[0] - 1).long()][..., None]).reshape(tokens * topk, x.shape[1])
    slot = torch.where(valid, torch.arange(tokens * topk, device="cuda", dtype=torch.int32).view(tokens, topk), -1)
    return rosekernels.moe_combine(rows, w, slot.to(torch.int32))


def _ep_step(ranks, xs, ids, ws, scale, sync=True):
    """One dispatch + expert + combine on every emulated rank, each on its stream; outputs per rank."""
    got = []
    for r, ep in enumerate(ranks):
        with torch.cuda.stream(ep.stream):
            got.append(ep.dispatch(xs[r], ids[r], ws[r]))
    outs = []
    for r, ep in enumerate(ranks):
        with torch.cuda.stream(ep.stream):
            outs.append(ep.combine(_experts_apply(got[r], ep.local_experts[0], scale)))
    if sync:
        torch.cuda.synchronize()
    return got, outs


@pytest.mark.gpu
@pytest.mark.parametrize("world,num_experts,hidden,topk,dtype,max_tokens,tokens", [
    (2, 256, 7168, 8, BF16, 128, (128, 37)),      # DeepSeek-V3 widths, decode
    (2, 128, 2048, 8, BF16, 128, (1, 0)),         # Qwen3-30B-A3B widths; an empty rank
    (3, 24, 2880, 6, FP16, 64, (5, 64, 33)),      # three ranks, ragged vectors per row
    (2, 128, 2048, 8, BF16, 8192, (8192, 4097)),  # prefill sizes (the receiver groups 16k rows)
])
def test_expert_parallel_equals_one_gpu(world, num_experts, hidden, topk, dtype, max_tokens, tokens):
    gen = torch.Generator().manual_seed(world * 1000 + hidden)
    ranks = moe.ExpertParallel.emulated(world, num_experts, hidden, max_tokens, topk, dtype)
    scale = _scale(num_experts, dtype)
    for step in range(2):  # the step counter: a second step with new data
        xs = [torch.randn(t, hidden, generator=gen).to("cuda", dtype) for t in tokens]
        routing = [_routing(t, num_experts, topk, gen) for t in tokens]
        ids, ws = [r[0] for r in routing], [r[1] for r in routing]
        got, outs = _ep_step(ranks, xs, ids, ws, scale)
        for r, ep in enumerate(ranks):
            ep.check()
            first, count = ep.local_experts
            mine = sum(int(((i >= first) & (i < first + count)).sum()) for i in ids)
            assert int(got[r].counts.sum()) == mine  # every pair routed here arrived, once
            assert torch.equal(outs[r], _single_gpu(xs[r], ids[r], ws[r], scale)), (step, r)


@pytest.mark.gpu
def test_expert_parallel_skew_and_dropped_pairs():
    """Every token of both ranks to rank 1's experts; then every pair dropped."""
    gen = torch.Generator().manual_seed(7)
    ranks = moe.ExpertParallel.emulated(2, 64, 1024, 128, 4, BF16)
    scale = _scale(64, BF16)
    xs = [torch.randn(100, 1024, generator=gen).to("cuda", BF16) for _ in range(2)]
    routing = [_routing(100, 64, 4, gen, drop=0.0, only=(32, 32)) for _ in range(2)]
    got, outs = _ep_step(ranks, xs, [r[0] for r in routing], [r[1] for r in routing], scale)
    assert int(got[0].counts.sum()) == 0 and int(got[1].counts.sum()) == 800
    for r in range(2):
        assert torch.equal(outs[r], _single_gpu(xs[r], routing[r][0], routing[r][1], scale))
    none = [torch.full((100, 4), -1, dtype=torch.int32, device="cuda") for _ in range(2)]
    got, outs = _ep_step(ranks, xs, none, [routing[0][1], routing[1][1]], scale)
    assert all(int(g.counts.sum()) == 0 for g in got) and all(not o.any() for o in outs)


@pytest.mark.gpu
def test_expert_parallel_invalid_ids_refuse_the_step_on_every_rank():
    gen = torch.Generator().manual_seed(8)
    ranks = moe.ExpertParallel.emulated(2, 16, 512, 32, 2, BF16)
    xs = [torch.randn(20, 512, generator=gen).to("cuda", BF16) for _ in range(2)]
    routing = [_routing(20, 16, 2, gen) for _ in range(2)]
    routing[0][0][3, 1] = 16  # one id past the experts, on rank 0 only
    got, outs = _ep_step(ranks, xs, [r[0] for r in routing], [r[1] for r in routing], _scale(16, BF16))
    for ep, out in zip(ranks, outs):
        with pytest.raises(ValueError, match="outside"):
            ep.check()
        assert not out.any()


@pytest.mark.gpu
def test_expert_parallel_graph_replays():
    """Both ranks' steps captured once, replayed with new inputs: the device-side step counter keeps
    every replay's flags fresh."""
    gen = torch.Generator().manual_seed(9)
    ranks = moe.ExpertParallel.emulated(2, 32, 2048, 64, 4, BF16)
    scale = _scale(32, BF16)
    xs = [torch.zeros(64, 2048, dtype=BF16, device="cuda") for _ in range(2)]
    ids = [torch.full((64, 4), -1, dtype=torch.int32, device="cuda") for _ in range(2)]
    ws = [torch.zeros(64, 4, device="cuda") for _ in range(2)]
    _ep_step(ranks, xs, ids, ws, scale)  # compiles and plans everything outside the capture
    graphs, outs = [], []
    for r, ep in enumerate(ranks):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=ep.stream):
            got = ep.dispatch(xs[r], ids[r], ws[r])
            outs.append(ep.combine(_experts_apply(got, ep.local_experts[0], scale)))
        graphs.append(g)
    for _ in range(3):
        for r in range(2):
            x, (i, w) = torch.randn(64, 2048, generator=gen).to("cuda", BF16), _routing(64, 32, 4, gen)
            xs[r].copy_(x), ids[r].copy_(i), ws[r].copy_(w)
        torch.cuda.synchronize()
        for r, ep in enumerate(ranks):
            with torch.cuda.stream(ep.stream):
                graphs[r].replay()
        torch.cuda.synchronize()
        for r, ep in enumerate(ranks):
            ep.check()
            assert torch.equal(outs[r], _single_gpu(xs[r], ids[r], ws[r], scale))


@pytest.mark.gpu
def test_a_peer_that_never_signals_times_out():
    ranks = moe.ExpertParallel.emulated(2, 16, 512, 8, 2, BF16, timeout_ms=50)
    x = torch.randn(8, 512, device="cuda").to(BF16)
    ids, w = _routing(8, 16, 2, torch.Generator().manual_seed(1))
    with torch.cuda.stream(ranks[0].stream):
        got = ranks[0].dispatch(x, ids, w)  # rank 1 never calls
        ranks[0].combine(got.buffer)
    torch.cuda.synchronize()
    for ep in ranks:  # rank 1 made no call: its error word was written by rank 0
        with pytest.raises(TimeoutError, match="rank 1 did not signal within 50 ms .seen by rank 0"):
            ep.check()
    tp = moe.TensorParallel.emulated(2, 16, 512, 8, 2, BF16, timeout_ms=50)
    with torch.cuda.stream(tp[1].stream):
        tp[1].all_reduce(x)
    torch.cuda.synchronize()
    for rank in tp:
        with pytest.raises(TimeoutError, match="rank 0 did not signal"):
            rank.check()


def _tp_reference(expert_outs, w, slots):
    return sum(mc.reference(y, w, s) for y, s in zip(expert_outs, slots))


@pytest.mark.gpu
@pytest.mark.parametrize("world,num_experts,hidden,topk,dtype,tokens", [
    (2, 128, 2048, 8, BF16, (1, 7, 128, 256)),   # decode: one fused launch
    (2, 128, 2048, 8, BF16, (257, 3000)),        # prefill: combine, then the reduce
    (4, 64, 2880, 6, FP16, (33,)),
])
def test_tensor_parallel_combine(world, num_experts, hidden, topk, dtype, tokens):
    gen = torch.Generator().manual_seed(world + hidden)
    ranks = moe.TensorParallel.emulated(world, num_experts, hidden, max(tokens), topk, dtype)
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen).to("cuda", dtype)
        ids, w = _routing(t, num_experts, topk, gen)
        got = [tp.dispatch(x, ids) for tp in ranks]
        ys = [torch.randn(g.buffer.shape, generator=gen).to("cuda", dtype) for g in got]
        torch.cuda.synchronize()
        outs = []
        for tp, g, y in zip(ranks, got, ys):
            with torch.cuda.stream(tp.stream):
                outs.append(tp.combine(y, w, g.slot_map))
        torch.cuda.synchronize()
        ref = _tp_reference(ys, w, [g.slot_map for g in got])
        terms = sum(mc.reference(y, w, g.slot_map, absolute=True) for y, g in zip(ys, got))
        rel = {BF16: 2.0**-8, FP16: 2.0**-10}[dtype]
        bound = rel * ref.abs() + (world + 1) * rel * terms + (topk + world + 2) * 2.0**-23 * terms + 1e-30
        # each rank's partial rounded to the dtype, the partials added in rank order in fp32
        partials = [rosekernels.moe_combine(y, w, g.slot_map) for y, g in zip(ys, got)]
        exact = sum(p.float() for p in partials).to(dtype)
        for tp, out in zip(ranks, outs):
            tp.check()
            assert torch.equal(out, exact)  # every rank the same bits
            err = (out.double() - ref).abs()
            assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.gpu
def test_tensor_parallel_all_reduce_steps_and_graphs():
    gen = torch.Generator().manual_seed(3)
    ranks = moe.TensorParallel.emulated(2, 8, 4096, 64, 2, BF16)
    xs = [torch.zeros(64, 4096, dtype=BF16, device="cuda") for _ in ranks]
    for _ in range(5):  # back to back: the inbox parity and the step counter
        for x in xs:
            x.copy_(torch.randn(64, 4096, generator=gen))
        torch.cuda.synchronize()
        outs = []
        for tp, x in zip(ranks, xs):
            with torch.cuda.stream(tp.stream):
                outs.append(tp.all_reduce(x))
        torch.cuda.synchronize()
        want = (xs[0].float() + xs[1].float()).to(BF16)
        assert all(torch.equal(o, want) for o in outs)
    graphs, outs = [], []
    for tp, x in zip(ranks, xs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=tp.stream):
            outs.append(tp.all_reduce(x))
        graphs.append(g)
    for _ in range(3):
        for x in xs:
            x.copy_(torch.randn(64, 4096, generator=gen))
        torch.cuda.synchronize()
        for tp, g in zip(ranks, graphs):
            with torch.cuda.stream(tp.stream):
                g.replay()
        torch.cuda.synchronize()
        want = (xs[0].float() + xs[1].float()).to(BF16)
        assert all(torch.equal(o, want) for o in outs)
    for tp in ranks:
        tp.check()


@pytest.mark.gpu
def test_ranks_running_ahead_of_each_other():
    """Ten steps queued on both ranks without a synchronisation, one rank's stream held back at the
    start, one rank without tokens on some steps. Expert parallel: a rank waits for exactly its step's
    flags (no peer can run a step ahead of it: it needs this rank's returns first). Tensor parallel: a
    fast rank may publish its next step before a slow one has read the last (its waits accept their
    step or the next; the inboxes alternate by parity)."""
    gen = torch.Generator().manual_seed(11)
    ranks = moe.ExpertParallel.emulated(2, 32, 1024, 64, 4, BF16)
    scale = _scale(32, BF16)
    steps = []
    for i in range(10):
        tokens = (64, 0 if i % 3 == 0 else 17)
        xs = [torch.randn(t, 1024, generator=gen).to("cuda", BF16) for t in tokens]
        routing = [_routing(t, 32, 4, gen) for t in tokens]
        steps.append((xs, [r[0] for r in routing], [r[1] for r in routing]))
    torch.cuda.synchronize()
    with torch.cuda.stream(ranks[0].stream):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds
    outs = [_ep_step(ranks, xs, ids, ws, scale, sync=False)[1] for xs, ids, ws in steps]
    torch.cuda.synchronize()
    for ep in ranks:
        ep.check()
    for (xs, ids, ws), step_outs in zip(steps, outs):
        for r in range(2):
            assert torch.equal(step_outs[r], _single_gpu(xs[r], ids[r], ws[r], scale))
    tps = moe.TensorParallel.emulated(2, 8, 2048, 64, 2, BF16)
    xs = [[torch.randn(64, 2048, generator=gen).to("cuda", BF16) for _ in tps] for _ in range(10)]
    torch.cuda.synchronize()
    with torch.cuda.stream(tps[1].stream):
        torch.cuda._sleep(50_000_000)
    outs = []
    for pair in xs:
        step_outs = []
        for tp, x in zip(tps, pair):
            with torch.cuda.stream(tp.stream):
                step_outs.append(tp.all_reduce(x))
        outs.append(step_outs)
    torch.cuda.synchronize()
    for tp in tps:
        tp.check()
    for pair, step_outs in zip(xs, outs):
        want = (pair[0].float() + pair[1].float()).to(BF16)
        assert all(torch.equal(o, want) for o in step_outs)


@pytest.mark.gpu
def test_bad_input_is_refused_before_any_launch():
    ranks = moe.ExpertParallel.emulated(2, 16, 512, 8, 2, BF16, timeout_ms=50)
    ep = ranks[0]
    x = torch.randn(8, 512, device="cuda").to(BF16)
    ids, w = _routing(8, 16, 2, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="at most 8"):
        ep.dispatch(torch.cat([x, x]), torch.cat([ids, ids]), torch.cat([w, w]))
    with pytest.raises(TypeError, match="dtype"):
        ep.dispatch(x.half(), ids, w)
    with pytest.raises(ValueError, match="shape"):
        ep.dispatch(x, ids[:, :1], w)
    with pytest.raises(RuntimeError, match="dispatch first"):
        ep.combine(x)
    with pytest.raises(ValueError, match="split evenly"):
        moe.ExpertParallel.emulated(3, 16, 512, 8, 2, BF16)
    with pytest.raises(RuntimeError, match="one stream per object"):  # the default stream, not the rank's
        ep.dispatch(x, ids, w)
    assert not ep.peers._mid_step
    torch.cuda.synchronize()
    assert all(int(r.peers.arena.count_nonzero()) == 0 for r in ranks)  # nothing was sent anywhere
    assert int(ep.state.count_nonzero()) == 0
    with torch.cuda.stream(ep.stream):  # out of turn (rank 1 never answers: the waits time out)
        got = ep.dispatch(x, ids, w)
        with pytest.raises(RuntimeError, match="dispatch called twice"):
            ep.dispatch(x, ids, w)
        ep.combine(got.buffer)
        with pytest.raises(RuntimeError, match="dispatch first"):
            ep.combine(got.buffer)
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError):
        ep.check()
    with torch.cuda.stream(ep.stream), pytest.raises(RuntimeError, match="unusable"):
        ep.dispatch(x, ids, w)  # after a failed step


# ---------------------------------------------------------------------------------------------
# GPU: the step counter, failures on every rank, arenas and streams

def _each(ranks, fn):
    """fn(rank, obj) on every emulated rank, each on its stream, all launched before any is waited for."""
    outs = []
    for r, obj in enumerate(ranks):
        with torch.cuda.stream(obj.stream):
            outs.append(fn(r, obj))
    return outs


def _ep_call(ep, x, ids, w, scale=None):
    """One step of `ep`: dispatch, the expert of _experts_apply (row * scale[its expert]; without a
    scale the rows go back as they arrived), combine. A result compared with _single_gpu(..., scale)
    needs the same scale: the reference applies it to every pair's row."""
    got = ep.dispatch(x, ids, w)
    return ep.combine(got.buffer if scale is None else _experts_apply(got, ep.local_experts[0], scale))


def _raises_everywhere(ranks, error, match):
    for obj in ranks:
        with pytest.raises(error, match=match):
            obj.check()


def _sleep_ms(ms):
    """Hold the current stream for at least `ms` (cycles at 2 GHz, above an H200's clock)."""
    torch.cuda._sleep(int(ms * 2e6))


def _int32(steps):
    return (steps + 2**31) % 2**32 - 2**31


@pytest.mark.gpu
@pytest.mark.parametrize("start", [2**31 - 3, 2**32 - 3])
def test_the_step_counter_crosses_2_31_and_2_32(start):
    """Both forms preset to `start` finished steps, then six more with changing token counts (TP grids of
    1 to all SMs): results exact, no error, the counter wrapped; afterwards every TP CTA flag of every
    sender holds the last step, also the slots the last (one-CTA) grid did not launch."""
    gen = torch.Generator().manual_seed(start % 1000)
    eps = moe.ExpertParallel.emulated(2, 32, 1024, 64, 4, BF16)
    tps = moe.TensorParallel.emulated(2, 8, 2048, 256, 2, BF16)
    for obj in eps + tps:
        obj._preset_step(start)
    scale = _scale(32, BF16)
    for ep_tokens, tp_tokens in [((64, 0), 256), ((5, 33), 7), ((0, 1), 200), ((17, 64), 0), ((64, 64), 64),
                                 ((3, 0), 1)]:
        xs = [torch.randn(t, 1024, generator=gen).to("cuda", BF16) for t in ep_tokens]
        routing = [_routing(t, 32, 4, gen) for t in ep_tokens]
        ys = [torch.randn(tp_tokens, 2048, generator=gen).to("cuda", BF16) for _ in tps]
        torch.cuda.synchronize()
        outs = _each(eps, lambda r, ep: _ep_call(ep, xs[r], *routing[r], scale))
        sums = _each(tps, lambda r, tp: tp.all_reduce(ys[r]))
        torch.cuda.synchronize()
        for r in range(2):
            assert torch.equal(outs[r], _single_gpu(xs[r], *routing[r], scale)), (ep_tokens, r)
            assert torch.equal(sums[r], (ys[0].float() + ys[1].float()).to(BF16)), (tp_tokens, r)
    for obj in eps + tps:
        obj.check()
        assert int(obj.state[mp.STATE_STEP]) == _int32(start + 6)
    for tp in tps:
        flags = tp.peers.view(tp.offsets[mp.TP_FLAG], (2, mp.MAX_CTAS), torch.int64)[:, :tp.slots]
        assert torch.equal(flags, torch.full_like(flags, (_int32(start + 6) << 32) | 1))  # step, 1 token


@pytest.mark.gpu
def test_a_call_one_rank_skips_fails_every_rank_in_bounded_time():
    """Rank 1 skips the second of three calls: its third pairs with rank 0's second, and rank 0's third
    waits in vain. Both ranks raise; a call made after the error (before check) runs without waiting."""
    gen = torch.Generator().manual_seed(21)
    eps = moe.ExpertParallel.emulated(2, 16, 512, 16, 2, BF16, timeout_ms=500)
    tps = moe.TensorParallel.emulated(2, 8, 512, 16, 2, BF16, timeout_ms=500)
    x = torch.randn(16, 512, generator=gen).to("cuda", BF16)
    ids, w = _routing(16, 16, 2, gen)
    torch.cuda.synchronize()
    start = time.monotonic()
    for call in range(3):
        _each(eps, lambda r, ep: None if (r, call) == (1, 1) else _ep_call(ep, x, ids, w))
        _each(tps, lambda r, tp: None if (r, call) == (1, 1) else tp.all_reduce(x))
    torch.cuda.synchronize()
    assert time.monotonic() - start < 5  # one timeout each, not one per later wait
    start = time.monotonic()
    _each(eps, lambda r, ep: _ep_call(ep, x, ids, w))
    _each(tps, lambda r, tp: tp.all_reduce(x))
    torch.cuda.synchronize()
    assert time.monotonic() - start < 0.25  # under the 500 ms timeout: the waits did not wait
    _raises_everywhere(eps, TimeoutError, "rank 1 did not signal within 500 ms .seen by rank 0")
    _raises_everywhere(tps, TimeoutError, "rank 1 did not signal within 500 ms .seen by rank 0")


@pytest.mark.gpu
def test_a_rank_asleep_past_the_timeout_fails_every_rank():
    gen = torch.Generator().manual_seed(22)
    eps = moe.ExpertParallel.emulated(2, 16, 512, 16, 2, BF16, timeout_ms=50)
    tps = moe.TensorParallel.emulated(2, 8, 512, 16, 2, BF16, timeout_ms=50)
    x = torch.randn(16, 512, generator=gen).to("cuda", BF16)
    ids, w = _routing(16, 16, 2, gen)
    torch.cuda.synchronize()
    for ranks, call in ((eps, lambda r, ep: _ep_call(ep, x, ids, w)), (tps, lambda r, tp: tp.all_reduce(x))):
        start = time.monotonic()
        with torch.cuda.stream(ranks[1].stream):
            _sleep_ms(200)
        _each(ranks, call)
        torch.cuda.synchronize()
        assert time.monotonic() - start < 5
        _raises_everywhere(ranks, TimeoutError, "rank 1 did not signal within 50 ms .seen by rank 0")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [(5, 7), (3000, 5)])  # 2 CTAs each at H=512 bf16; 132 against 2
def test_tensor_parallel_token_counts_that_disagree_fail_every_rank_at_once(tokens):
    """No timeout needed (the default, 10 s, is not reached): each rank reads the other's count in the
    flags of the step."""
    gen = torch.Generator().manual_seed(sum(tokens))
    tps = moe.TensorParallel.emulated(2, 8, 512, 4096, 2, BF16)
    xs = [torch.randn(t, 512, generator=gen).to("cuda", BF16) for t in tokens]
    torch.cuda.synchronize()
    start = time.monotonic()
    _each(tps, lambda r, tp: tp.all_reduce(xs[r]))
    torch.cuda.synchronize()
    assert time.monotonic() - start < 2
    a, b = tokens
    _raises_everywhere(tps, RuntimeError, rf"with ({a} tokens on rank 0 and {b}|{b} tokens on rank 1 and {a}) on "
                                          "rank [01] .every rank must pass the same count")


@pytest.mark.gpu
@pytest.mark.parametrize("form,behind", [("ep", 2), ("tp", 3)])
def test_a_flag_further_ahead_than_the_protocol_allows_fails_every_rank(form, behind):
    """Rank 0's counter set `behind` steps back (as a second object on its arena would see it): its next
    step reads rank 1's flags (the preset ones, or newer) one step further ahead than its waits allow
    (expert parallel: none; tensor parallel: one)."""
    gen = torch.Generator().manual_seed(23)
    if form == "ep":
        ranks = moe.ExpertParallel.emulated(2, 16, 512, 16, 2, BF16, timeout_ms=500)
        ids, w = _routing(16, 16, 2, gen)
        call = lambda r, ep: _ep_call(ep, x, ids, w)  # noqa: E731
    else:
        ranks = moe.TensorParallel.emulated(2, 8, 512, 16, 2, BF16, timeout_ms=500)
        call = lambda r, tp: tp.all_reduce(x)  # noqa: E731
    x = torch.randn(16, 512, generator=gen).to("cuda", BF16)
    for obj in ranks:
        obj._preset_step(1000)
    ranks[0].state[mp.STATE_STEP] = 1000 - behind
    torch.cuda.synchronize()
    start = time.monotonic()
    _each(ranks, call)
    torch.cuda.synchronize()
    assert time.monotonic() - start < 0.25  # rank 1's wait ended on rank 0's report, not its timeout
    _raises_everywhere(ranks, RuntimeError, "rank 0 read a flag of rank 1 from a later step than any peer")


@pytest.mark.gpu
def test_a_failure_inside_graphs_fails_every_rank():
    """Both ranks' steps captured; one replay on both, then one on rank 0 alone."""
    gen = torch.Generator().manual_seed(24)
    eps = moe.ExpertParallel.emulated(2, 16, 512, 16, 2, BF16, timeout_ms=50)
    x = torch.randn(16, 512, generator=gen).to("cuda", BF16)
    ids, w = _routing(16, 16, 2, gen)
    scale = _scale(16, BF16)
    _each(eps, lambda r, ep: _ep_call(ep, x, ids, w))
    torch.cuda.synchronize()
    graphs, outs = [], []
    for ep in eps:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=ep.stream):
            outs.append(ep.combine(_experts_apply(ep.dispatch(x, ids, w), ep.local_experts[0], scale)))
        graphs.append(g)
    _each(eps, lambda r, ep: graphs[r].replay())
    torch.cuda.synchronize()
    for ep, out in zip(eps, outs):
        ep.check()
        assert torch.equal(out, _single_gpu(x, ids, w, scale))
    with torch.cuda.stream(eps[0].stream):
        graphs[0].replay()
    torch.cuda.synchronize()
    _raises_everywhere(eps, TimeoutError, "rank 1 did not signal")


@pytest.mark.gpu
def test_one_object_per_arena_and_the_step_stays_with_it():
    gen = torch.Generator().manual_seed(25)
    scale = _scale(32, BF16)
    args = (32, 1024, 64, 4, BF16)
    peers = moe.Peers.emulated(2, moe._layout(moe.ExpertParallel.regions(2, 1024, 64, 4, BF16))[1])
    eps = [moe.ExpertParallel(*args, peers=p, timeout_ms=50) for p in peers]
    with pytest.raises(ValueError, match="in use by a live ExpertParallel"):
        moe.ExpertParallel(*args, peers=peers[0])

    def step(ranks):
        xs = [torch.randn(t, 1024, generator=gen).to("cuda", BF16) for t in (40, 9)]
        routing = [_routing(t, 32, 4, gen) for t in (40, 9)]
        torch.cuda.synchronize()
        outs = _each(ranks, lambda r, ep: _ep_call(ep, xs[r], *routing[r], scale))
        torch.cuda.synchronize()
        for r, ep in enumerate(ranks):
            ep.check()
            assert torch.equal(outs[r], _single_gpu(xs[r], *routing[r], scale))

    step(eps)
    step(eps)
    del eps
    gc.collect()
    eps = [moe.ExpertParallel(*args, peers=p, timeout_ms=50) for p in peers]  # continues at step 2
    assert all(int(ep.state[mp.STATE_STEP]) == 2 for ep in eps)
    step(eps)
    assert all(int(ep.state[mp.STATE_STEP]) == 3 for ep in eps)
    with torch.cuda.stream(eps[0].stream):  # rank 0 alone: the arenas now hold an error
        _ep_call(eps[0], *_single_batch(gen))
    torch.cuda.synchronize()
    del eps
    gc.collect()
    with pytest.raises(ValueError, match="another layout"):
        moe.TensorParallel(8, 1024, 64, 4, BF16, peers=peers[0])
    with pytest.raises(RuntimeError, match="holds the error of an earlier step"):
        moe.ExpertParallel(*args, peers=peers[1])


@pytest.mark.gpu
def test_objects_dropped_between_dispatch_and_combine_leave_their_arenas_refused():
    """Both ranks dispatch, then drop their objects before combining: new objects on those arenas would
    repeat the abandoned step against the peers' flags of it (waits passing at once on rows being
    rewritten), so each rank refuses them; new arenas serve."""
    gen = torch.Generator().manual_seed(26)
    scale = _scale(32, BF16)
    args = (32, 1024, 64, 4, BF16)
    peers = moe.Peers.emulated(2, moe._layout(moe.ExpertParallel.regions(2, 1024, 64, 4, BF16))[1])
    eps = [moe.ExpertParallel(*args, peers=p, timeout_ms=500) for p in peers]
    batches = [_single_batch(gen) for _ in eps]
    _each(eps, lambda r, ep: ep.dispatch(*batches[r]))
    torch.cuda.synchronize()
    del eps
    gc.collect()
    for p in peers:
        with pytest.raises(RuntimeError, match=rf"rank {p.rank}'s arena was left mid-step"):
            moe.ExpertParallel(*args, peers=p)
    eps = moe.ExpertParallel.emulated(2, *args)
    outs = _each(eps, lambda r, ep: _ep_call(ep, *batches[r], scale))
    torch.cuda.synchronize()
    for r, ep in enumerate(eps):
        ep.check()
        assert torch.equal(outs[r], _single_gpu(*batches[r], scale))


@pytest.mark.gpu
def test_ranks_built_with_other_experts_are_refused_on_every_rank():
    """Rank 1 built with 16 experts against rank 0's 32 (the same arena layout: nothing else would
    catch it, and each rank would route tokens to experts the other does not own): rank 1 refuses,
    rank 0's object is failed before it sends anything; rebuilt alike, the ranks run."""
    gen = torch.Generator().manual_seed(26)
    peers = moe.Peers.emulated(2, moe._layout(moe.ExpertParallel.regions(2, 512, 16, 2, BF16))[1])
    first = moe.ExpertParallel(32, 512, 16, 2, BF16, peers=peers[0], timeout_ms=50)
    with pytest.raises(ValueError, match=r"disagree on num_experts \(rank 0: 32, rank 1: 16\)"):
        moe.ExpertParallel(16, 512, 16, 2, BF16, peers=peers[1], timeout_ms=50)
    x = torch.randn(16, 512, generator=gen).to("cuda", BF16)
    ids, w = _routing(16, 32, 2, gen)
    with torch.cuda.stream(first.stream), pytest.raises(RuntimeError, match="disagree on num_experts.*unusable"):
        first.dispatch(x, ids, w)
    torch.cuda.synchronize()
    assert all(int(p.arena.count_nonzero()) == 0 for p in peers)  # nothing was sent
    del first
    gc.collect()
    eps = [moe.ExpertParallel(32, 512, 16, 2, BF16, peers=p, timeout_ms=50) for p in peers]
    scale = _scale(32, BF16)
    outs = _each(eps, lambda r, ep: _ep_call(ep, x, ids, w, scale))
    torch.cuda.synchronize()
    for ep, out in zip(eps, outs):
        ep.check()
        assert torch.equal(out, _single_gpu(x, ids, w, scale))


@pytest.mark.gpu
def test_a_combine_ends_only_once_every_peer_flagged_every_row_of_it():
    """Rank 1 sends one token of max_tokens 1024, rank 0 all 1024, every pair to rank 0's experts
    (8 rows of 14 KB to copy per row of rank 0's ep_return, before it reaches most of rank 1's rows):
    rank 1's combine must wait for rank 0 to have flagged every one of rank 1's rows, also those past
    its batch (its next dispatch overwrites their ids, which rank 0's ep_return reads until it flags
    them). A copy of rank 1's return flags taken in its stream right after the combine holds the
    step in every row; waiting on the batch's row alone, most were still a step behind."""
    gen = torch.Generator().manual_seed(27)
    ranks = moe.ExpertParallel.emulated(2, 256, 7168, 1024, 8, BF16)  # the CPU tests' ep_* configs
    tokens = (1024, 1)
    xs = [torch.randn(t, 7168, generator=gen).to("cuda", BF16) for t in tokens]
    routing = [_routing(t, 256, 8, gen, drop=0.0, only=(0, 128)) for t in tokens]
    scale = _scale(256, BF16)
    torch.cuda.synchronize()
    outs = _each(ranks, lambda r, ep: _ep_call(ep, xs[r], *routing[r], scale))
    with torch.cuda.stream(ranks[1].stream):
        flags = ranks[1].peers.view(ranks[1].offsets[mp.EP_RFLAG], (2, 1024), torch.int64).clone()
    torch.cuda.synchronize()
    assert torch.equal(flags >> 32, torch.ones_like(flags)), int((flags >> 32 != 1).sum())
    for r, ep in enumerate(ranks):
        ep.check()
        assert torch.equal(outs[r], _single_gpu(xs[r], *routing[r], scale))


def _single_batch(gen):
    x = torch.randn(8, 1024, generator=gen).to("cuda", BF16)
    return (x, *_routing(8, 32, 4, gen))
