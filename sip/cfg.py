"""The control-flow graph of a kernel's basic blocks, its dominators and its natural loops.

Edges: a block falls through to the next one unless it ends in an unconditional jump, return,
exit or kill (an unpredicated BRA / JMP / BRX / JMX / RET / EXIT / KILL), and a jump (BRA, JMP,
BRX, JMX) adds an edge to each static target. A CALL adds no edge to its callee (control comes
back after it), a BSSY none to its reconvergence point (it is no jump), and targets that are not
static are not seen (BREAK, BRX without a target list): a missed edge can only hide a loop.

Loops are natural loops: a back edge u -> h is an edge whose target h dominates u (every path from
an entry to u passes h); its loop is h plus every block that reaches u without passing h. The loop
depth of a block is the number of loop headers whose loops contain it. sip.mutate proposes moves in
deeper loops more often (hot blocks first).
"""
from __future__ import annotations

import collections
import dataclasses

from sip.cubin import INSTRUCTION_BYTES
from sip.sass import Kernel

_JUMPS = frozenset({"BRA", "BRX", "BRXU", "JMP", "JMX", "JMXU"})
_NO_FALL_THROUGH = _JUMPS | {"RET", "EXIT", "KILL"}


def successors(kernel: Kernel) -> tuple[tuple[int, ...], ...]:
    """Per block, the blocks control may go to next (see the module doc)."""
    out = []
    for b, rng in enumerate(kernel.blocks):
        last = kernel.instructions[rng[-1]]
        succ = []
        if last.control_flow and last.base in _JUMPS:
            succ += [kernel.block_of[t // INSTRUCTION_BYTES] for t in last.targets]
        unconditional = last.predicate in ("", "@PT", "@UPT")
        if not (last.control_flow and last.base in _NO_FALL_THROUGH and unconditional) \
                and b + 1 < len(kernel.blocks):
            succ.append(b + 1)
        out.append(tuple(dict.fromkeys(succ)))
    return tuple(out)


def entry_blocks(kernel: Kernel) -> tuple[int, ...]:
    """Blocks control may enter the kernel at (its start, and entries the cubin lists)."""
    return tuple(sorted({kernel.block_of[off // INSTRUCTION_BYTES] for off in kernel.code.entries
                         if off // INSTRUCTION_BYTES < len(kernel.instructions)} | {0}))


def dominators(succ: tuple[tuple[int, ...], ...], entries: tuple[int, ...]) -> list[int | None]:
    """Immediate dominator of each block (an entry: itself; unreachable: None), by the iterative
    algorithm of Cooper, Harvey and Kennedy over a reverse postorder from a virtual root."""
    n = len(succ)
    root = n  # the virtual root precedes every entry
    order: list[int] = []
    seen = [False] * (n + 1)
    for start in entries:
        if seen[start]:
            continue
        seen[start] = True
        stack = [(start, iter(succ[start]))]
        while stack:
            node, it = stack[-1]
            nxt = next((s for s in it if not seen[s]), None)
            if nxt is None:
                stack.pop()
                order.append(node)
            else:
                seen[nxt] = True
                stack.append((nxt, iter(succ[nxt])))
    rpo = order[::-1]
    number = {b: k for k, b in enumerate(rpo)}
    number[root] = -1
    preds: list[list[int]] = [[] for _ in range(n)]
    for b in rpo:
        for s in succ[b]:
            preds[s].append(b)
    for e in entries:
        preds[e].append(root)
    idom: dict[int, int] = {root: root}

    def intersect(a: int, b: int) -> int:
        while a != b:
            while number[a] > number[b]:
                a = idom[a]
            while number[b] > number[a]:
                b = idom[b]
        return a

    changed = True
    while changed:
        changed = False
        for b in rpo:
            done = [p for p in preds[b] if p in idom]
            new = done[0]
            for p in done[1:]:
                new = intersect(p, new)
            if idom.get(b) != new:
                idom[b] = new
                changed = True
    return [None if b not in idom else (b if idom[b] == root else idom[b]) for b in range(n)]


def dominates(idom: list[int | None], a: int, b: int) -> bool:
    """Whether block a dominates block b (both reachable)."""
    while True:
        if b == a:
            return True
        up = idom[b]
        if up is None or up == b:
            return False
        b = up


def loops(kernel: Kernel) -> dict[int, frozenset[int]]:
    """Natural loops: header block -> the blocks of its loop (all back edges to it merged)."""
    succ = successors(kernel)
    idom = dominators(succ, entry_blocks(kernel))
    preds: list[list[int]] = [[] for _ in succ]
    for b, ss in enumerate(succ):
        for s in ss:
            preds[s].append(b)
    found: dict[int, set[int]] = {}
    for u, ss in enumerate(succ):
        for h in ss:
            if idom[u] is None or idom[h] is None or not dominates(idom, h, u):
                continue
            body = found.setdefault(h, {h})
            stack = [u]
            while stack:
                x = stack.pop()
                if x not in body:
                    body.add(x)
                    stack.extend(preds[x])
    return {h: frozenset(body) for h, body in found.items()}


def loop_depth(kernel: Kernel) -> tuple[int, ...]:
    """Per block, how many loops contain it (0: straight-line code outside every loop)."""
    depth = [0] * len(kernel.blocks)
    for body in loops(kernel).values():
        for b in body:
            depth[b] += 1
    return tuple(depth)


@dataclasses.dataclass(frozen=True)
class LoopSummary:
    """One natural loop, as `sip loops` prints it."""

    header: int  # block number
    offset: int  # of the header's first instruction
    depth: int  # loops containing the header (1: an outermost loop)
    blocks: int
    instructions: int
    stall_cycles: int  # the sum of the loop's stall counts: what one pass takes to issue, before any wait
    opcodes: tuple[tuple[str, int], ...]  # (base opcode, count), most frequent first


def loop_summaries(kernel: Kernel) -> list[LoopSummary]:
    """Every natural loop of `kernel`, deepest first (then by offset): where a kernel spends its
    issue slots, and where two schedules of the same loop differ (e.g. the same source compiled with
    another option: the stall sums of the loop say by how much before anything is timed)."""
    depth = loop_depth(kernel)
    out = []
    for header, body in loops(kernel).items():
        members = [i for b in body for i in kernel.blocks[b]]
        ops = collections.Counter(kernel.instructions[i].base for i in members)
        out.append(LoopSummary(header, kernel.instructions[kernel.blocks[header].start].offset, depth[header],
                               len(body), len(members), sum(kernel.instructions[i].control.stall for i in members),
                               tuple(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))))
    return sorted(out, key=lambda s: (-s.depth, s.offset))
