"""sip.mutate's classes of changes on the whole corpus: membership, and legality by construction -
many random changes of each class, every guarantee rechecked from scratch along the way, the cubin
written back and decoded by nvdisasm."""
import json
import random

import pytest
from sip_checks import assert_round_trip, assert_schedule_is_correct
from sip_corpus import CORPUS_NAMES, corpus  # noqa: F401

from sip import SipError, latency
from sip.cubin import parse_cubin
from sip.deps import DependencyModel
from sip.mutate import (CONTROL_KINDS, DEFAULT_MOVES, MOVE_CLASSES, Edit, Move, Schedule, move_class, parse_moves,
                        random_walk, step)
from sip.sass import disassemble

POLICIES = {  # what each test walk may change; control.stall is tested with a table in test_control
    "global": frozenset({"global"}),
    "shared": frozenset({"shared"}),
    "alu": frozenset({"alu"}),
    "control": frozenset({"control.yield", "control.reuse"}),
    "moves": frozenset(MOVE_CLASSES),
}


@pytest.fixture(scope="module")
def synthetic_table(tmp_path_factory, kernels):
    """A latency table for the mechanism of control.stall (NOT a hardware claim): every class
    pair the corpus holds, 2 cycles through every register file."""
    classes = {latency.opclass(i) for _, kernel, _ in kernels for i in kernel.instructions}
    path = tmp_path_factory.mktemp("table") / "synthetic.json"
    path.write_text(json.dumps({"format": latency.FORMAT, "pairs": [
        {"producer": p, "consumer": c, "file": f, "latency": 2}
        for p in classes for c in classes for f in latency.FILES]}))
    return latency.load(path)


@pytest.fixture(scope="module")
def kernels(corpus):
    """(corpus name, kernel, dependency model) of every corpus kernel."""
    out = []
    for name in CORPUS_NAMES:
        if name in corpus:
            for kernel in disassemble(parse_cubin(corpus[name])).values():
                out.append((name, kernel, DependencyModel(kernel)))
    return out


# ---------------------------------------------------------------- names and membership

def test_parse_moves_names_classes_and_kinds():
    assert parse_moves("global") == DEFAULT_MOVES
    assert parse_moves("alu, shared") == {"alu", "shared"}
    assert parse_moves("control") == set(CONTROL_KINDS)
    assert parse_moves("all") == {*MOVE_CLASSES, *CONTROL_KINDS}
    assert parse_moves("global,control.reuse") == {"global", "control.reuse"}
    for bad in ("alus", "global,,shared", "control.stalls", "ALL"):
        with pytest.raises(SipError, match="unknown move class") as e:
            parse_moves(bad)
        assert "\n" not in str(e.value)


def test_every_instruction_is_in_the_class_its_memory_space_says(kernels):
    seen = set()
    for _, kernel, model in kernels:
        for i in kernel.instructions:
            c = move_class(i)
            seen.add(c)
            loads, stores = model.facts[i.index].loads, model.facts[i.index].stores
            if c == "global":
                assert loads | stores <= {"global", "shared", "generic"} and "global" in loads | stores, i.text
            elif c == "shared":
                assert loads | stores == {"shared"}, i.text
            elif c == "alu":
                assert not loads | stores, i.text  # no memory access (constant loads have none in the model)
            else:
                assert loads | stores & {"local", "generic"}, i.text
    assert seen == {"global", "shared", "alu", None}


def test_modelled_64_bit_uniform_operands_are_movable(kernels):
    """UIADD3.64 and USHF.*.U64 used to be pinned for lack of a model (corpus entry uniform64)."""
    found = {}
    for name, kernel, model in kernels:
        s = Schedule.initial(model, frozenset({"alu"}))
        for i in kernel.instructions:
            if i.opcode == "UIADD3.64" or (i.base == "USHF" and {"U64", "S64"} & set(i.modifiers)):
                assert model.facts[i.index].pin is None, i.text
                legal = [d for d in (-1, 1) if s.check(Move(i.index, d)) is None]
                found.setdefault(i.base, []).append(bool(legal))
    if not found:
        pytest.skip("corpus entry uniform64 not built")
    assert set(found) == {"UIADD3", "USHF"} and all(any(v) for v in found.values())


# ---------------------------------------------------------------- legality by construction

@pytest.mark.slow
@pytest.mark.parametrize("policy", [*POLICIES, "all, synthetic table"])
def test_random_changes_of_each_class_keep_every_guarantee(kernels, policy, synthetic_table):
    """Per corpus kernel: a walk of random legal changes of the class, every guarantee rechecked
    from scratch after every change (every 20th in kernels over 600 instructions), then the cubin
    written and decoded by nvdisasm. With the synthetic table, stall counts go down too."""
    moves = POLICIES.get(policy, parse_moves("all"))
    walked = lowered = 0
    for name, kernel, model in kernels:
        if "control.stall" in moves:
            model = DependencyModel(kernel, synthetic_table)
        s0 = Schedule.initial(model, moves)
        s, rng = s0, random.Random(f"{policy}/{name}/{kernel.name}")
        every = 1 if len(kernel.instructions) <= 600 else 20
        done = []
        for k in range(300):
            taken = step(s, rng)
            if taken is None:
                break
            s, change = taken
            done.append(change)
            if k % every == 0:
                assert_schedule_is_correct(s, check_order=k % (5 * every) == 0)
                assert _class_of(kernel, change) in moves, (name, change)
        assert_schedule_is_correct(s)
        assert_round_trip(s)
        if policy == "control":  # edits change control bits only: same order, same instruction bits
            assert s.order() == s0.order()
            for x in range(len(kernel.instructions)):
                assert (s.text[16 * x:16 * x + 13] == s0.text[16 * x:16 * x + 13])
        walked += bool(done)
        lowered += sum(s.own[x] < s0.own[x] for x in range(len(kernel.instructions)))
    assert walked >= len(kernels) // 2
    assert ("control.stall" in moves) == (lowered > 0)


def test_moving_back_restores_the_original_exactly_for_every_move_class(kernels):
    for name, kernel, model in kernels:
        s0 = Schedule.initial(model, frozenset(MOVE_CLASSES))
        s, done = random_walk(s0, 300, seed=4)
        for move in reversed(done):
            s = s.moved(Move(move.instruction, -move.direction))
        assert s == s0 and s.text == s0.text, name


def test_listed_changes_are_exactly_the_legal_ones(kernels):
    rng = random.Random(2)
    for name, kernel, model in kernels:
        s = Schedule.initial(model, POLICIES["moves"] | POLICIES["control"])
        legal = set(s.moves())
        for kind in s.layout.candidates:
            assert set(s.moves(kind)) <= legal
        candidates = [c for kind, xs in s.layout.candidates.items() for x in xs for c in s._options(kind, x)]
        for change in rng.sample(candidates, min(len(candidates), 80)):
            if change in legal:
                assert_schedule_is_correct(s.moved(change), check_order=False)
            else:
                assert s.check(change)


def test_a_walk_changes_only_what_its_classes_name(kernels):
    for name, kernel, model in kernels:
        for policy in ("global", "alu", "control"):
            s, done = random_walk(Schedule.initial(model, POLICIES[policy]), 100, seed=9)
            assert all(_class_of(kernel, c) in POLICIES[policy] for c in done), (name, policy)


def _class_of(kernel, change):
    if isinstance(change, Edit):
        return change.kind
    return move_class(kernel.instructions[change.instruction])


def test_moves_pass_address_pinned_instructions_on_real_code(kernels):
    """isa_zoo's warp-wide instructions are listed in .nv.info (pinned to their address, no fences):
    walks hop over them, and the pinned instructions keep their slots (assert_schedule_is_correct)."""
    hops = 0
    for name, kernel, model in kernels:
        if name != "isa_zoo":
            continue
        assert any(f.pin and not f.fence for f in model.facts)
        s, rng = Schedule.initial(model, POLICIES["moves"]), random.Random(0)
        for _ in range(2000):
            taken = step(s, rng)
            if taken is None:
                break
            t, change = taken
            hops += abs(t.slots[change.instruction] - s.slots[change.instruction]) > 1
            s = t
        assert_schedule_is_correct(s)
    if not any(name == "isa_zoo" for name, _, _ in kernels):
        pytest.skip("corpus entry isa_zoo not built")
    assert hops > 0
