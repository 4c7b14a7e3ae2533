"""Parametrized grids that CI samples and the GPU suite (tools/gpu_suite.py) runs whole.

ROSEKERNELS_TEST_GRID=full keeps every case. Otherwise (CI, a plain pytest run) a grid keeps a few
cases that between them hold a member of every family: each function of `families` sorts the cases
into families (e.g. one tile kind with one dtype and bias; one tile shape), so a broken family fails
CI whichever way it is cut. The cases are picked greedily, each covering the most families not yet
covered, ties to the smallest CRC-32 of the case's key: the sample is the same on every run, and the
member that stands for a family differs from family to family rather than always being the first.
Tests over a grid carry the `grid` mark, which the GPU suite selects."""
import os
import zlib
from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")

FULL = os.environ.get("ROSEKERNELS_TEST_GRID") == "full"


def sample(cases: Sequence[T], families: Sequence[Callable[[T], Hashable]], key: Callable[[T], str],
           full: bool = FULL) -> list[T]:
    """`cases` whole when `full`, else the sample, in the grid's order."""
    if full:
        return list(cases)
    keys = [key(c) for c in cases]
    labels = [{(i, f(c)) for i, f in enumerate(families)} for c in cases]
    order = sorted(range(len(cases)), key=lambda j: zlib.crc32(keys[j].encode()))
    uncovered = set().union(*labels)
    kept = set()
    while uncovered:
        best = max(order, key=lambda j: len(labels[j] & uncovered))
        kept.add(best)
        uncovered -= labels[best]
    return [c for j, c in enumerate(cases) if j in kept]
