"""Simulated annealing over schedules (SIP paper, Algorithm 1), independent of what a state is.

    T <- T_max; x_best <- x
    while T > T_min:
        x' <- perturb(x);  dE <- E(x') - E(x)
        accept x' if dE < 0, else with probability exp(-dE / T); keep the best ever seen
        T <- T / L

Energies here are kernel times RELATIVE to the original kernel measured right next to them (1.0 =
as fast as the original), so temperatures read as fractions: T = 0.01 accepts a 1 % slower schedule
with probability 1/e. A candidate that fails testing or crashes has energy +inf and is never accepted.
The paper's feedback signal R = (E_{i-1} - E_i) / E_0 is recorded for every step.

Budgets: with `max_iters` (and no explicit cooling factor L) the factor is derived so that T reaches
T_min exactly at the last iteration, L = (T_max / T_min) ** (1 / max_iters); with `max_seconds` the
same geometric schedule runs on the elapsed fraction of the budget. Reproducibility: the proposal and
acceptance streams are seeded separately and every iteration draws the same number of acceptance
numbers, so with the same seed and the same energies the same schedules are proposed in the same order.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from typing import Callable, Generic, Hashable, TypeVar

S = TypeVar("S")


@dataclasses.dataclass(frozen=True)
class AnnealConfig:
    t_max: float = 0.02
    t_min: float = 2e-4
    cooling: float | None = None  # L > 1: T <- T / L per iteration; None: derived from the budget
    max_iters: int | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if not (self.t_max > self.t_min > 0):
            raise ValueError(f"need T_max > T_min > 0, got T_max={self.t_max}, T_min={self.t_min}")
        if self.cooling is not None and not self.cooling > 1:
            raise ValueError(f"the cooling factor L must be > 1, got {self.cooling}")
        if self.max_iters is not None and self.max_iters < 1:
            raise ValueError("max_iters must be >= 1")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError("max_seconds must be > 0")
        if self.cooling is None and self.max_iters is None and self.max_seconds is None:
            raise ValueError("give a budget (max_iters or max_seconds) or a cooling factor")

    def temperature(self, i: int, elapsed: float) -> float | None:
        """Temperature of iteration i (0-based) after `elapsed` seconds; None once the search is over."""
        if self.max_iters is not None and i >= self.max_iters:
            return None
        if self.max_seconds is not None and elapsed >= self.max_seconds:
            return None
        if self.cooling is not None:
            t = self.t_max / self.cooling ** i
            return t if t > self.t_min else None
        frac = 0.0
        if self.max_iters is not None:
            frac = i / self.max_iters
        if self.max_seconds is not None:
            frac = max(frac, elapsed / self.max_seconds)
        return self.t_max * (self.t_min / self.t_max) ** frac

    def split(self, runs: int) -> "AnnealConfig":
        """The config for one of `runs` runs sharing this budget."""
        return dataclasses.replace(
            self,
            max_iters=None if self.max_iters is None else max(1, self.max_iters // runs),
            max_seconds=None if self.max_seconds is None else self.max_seconds / runs)


@dataclasses.dataclass(frozen=True)
class Step:
    i: int
    temperature: float
    proposed: float  # energy of the proposed state (inf: failed testing or crashed)
    current: float  # energy of the current state after the decision
    best: float
    accepted: bool
    reward: float  # (E_{i-1} - E_i) / E_0, the paper's feedback signal; 0 for a failed candidate
    seconds: float  # since the run started


@dataclasses.dataclass
class AnnealResult(Generic[S]):
    best: S
    best_energy: float
    initial_energy: float
    steps: list[Step]
    top: list[tuple[float, Hashable, S]]  # the best distinct states seen, lowest energy first
    seconds: float

    @property
    def iterations(self) -> int:
        return len(self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)


def streams(seed: int) -> tuple[random.Random, random.Random]:
    """Independent (proposal, acceptance) generators for a run seed."""
    return random.Random(f"sip-propose-{seed}"), random.Random(f"sip-accept-{seed}")


def anneal(initial: S,
           neighbour: Callable[[S, random.Random], S | None],
           energy: Callable[[S], float],
           config: AnnealConfig,
           seed: int,
           *,
           key: Callable[[S], Hashable] = lambda s: s,
           keep: int = 8,
           on_step: Callable[[Step], None] | None = None,
           clock: Callable[[], float] = time.monotonic) -> AnnealResult[S]:
    """Minimise `energy` from `initial`; `neighbour(state, rng)` proposes a perturbed state (None: no
    legal move exists). Returns the best state and the `keep` best distinct states seen."""
    propose_rng, accept_rng = streams(seed)
    start = clock()
    current, e_cur = initial, energy(initial)
    e_init = e_cur
    e0 = e_cur if math.isfinite(e_cur) and e_cur != 0 else 1.0
    best, e_best = current, e_cur
    top: dict[Hashable, tuple[float, S]] = {key(initial): (e_cur, initial)}
    steps: list[Step] = []
    i = 0
    while True:
        t = config.temperature(i, clock() - start)
        if t is None:
            break
        proposal = neighbour(current, propose_rng)
        r = accept_rng.random()  # drawn every iteration: the streams stay aligned across runs
        if proposal is None:
            break
        e_new = energy(proposal)
        d = e_new - e_cur
        accepted = d < 0 or (math.isfinite(d) and r < math.exp(-d / t))
        reward = (e_cur - e_new) / e0 if math.isfinite(e_new) else 0.0
        if accepted:
            current, e_cur = proposal, e_new
            if e_cur < e_best:
                best, e_best = current, e_cur
        if math.isfinite(e_new):
            k = key(proposal)
            if k not in top or e_new < top[k][0]:
                top[k] = (e_new, proposal)
                if len(top) > 4 * keep:  # prune now and then; the cut below is exact
                    top = dict(heapq.nsmallest(keep, top.items(), key=lambda kv: kv[1][0]))
        step = Step(i, t, e_new, e_cur, e_best, accepted, reward, clock() - start)
        steps.append(step)
        if on_step is not None:
            on_step(step)
        i += 1
    ranked = sorted(((e, k, s) for k, (e, s) in top.items()), key=lambda x: x[0])[:keep]
    return AnnealResult(best, e_best, e_init, steps, ranked, clock() - start)
