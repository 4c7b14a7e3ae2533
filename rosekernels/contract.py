"""The kernel-module contract: the names every module in `rosekernels.kernels` (listed in
`rosekernels.KERNELS`) defines, so that warm-up, tests and the tuner treat every kernel alike.

    Config                   frozen dataclass: everything one launch is specialised on; compile-time
                             fields go into `variant()` (the compile and tuned-store key), launch
                             policy (grid, split counts) may stay out of it. `Config.from_variant(v)`
                             inverts `variant()`.
    Shape                    frozen dataclass of the problem sizes and options a call has (token count,
                             heads, hidden size, dtype, ...); `Shape.defaults(mode)` is the shape
                             `sip-tune --mode` tunes when no --shape is given; `Shape.SIZE_FIELDS`
                             names the fields that vary from call to call (token or row counts,
                             sequence lengths): `bucket` rounds them to group shapes for the tuned
                             store.
    config_for(shape)        today's heuristic choice for `shape` (it decides the mode).
    candidates(shape)        every legal Config that can serve `shape`: the autotuner's search space
                             (the heuristic's choice among them).
    compile(config)          the loaded kernel (`jit.CompiledKernel`), from the compile caches.
    variants_for(models, modes, max_tokens)
                             the Configs that models (`rosekernels.models.ModelDims`; None: the
                             library's default coverage) need at warm-up, for the given modes and
                             calls of at most max_tokens tokens (None: any; kernels whose variants do
                             not depend on the token count take it and list the same set).
    workload(config, shape)  a `rosekernels.workload.Workload`: inputs of `shape`, outputs, the float64
                             check and the launch of `config`'s kernel, for tests and the tuner.

Configs, shapes and heuristics live in the kernel's plan module (`<kernel>_plan.py`), which imports
neither CuTeDSL nor the device code, so they are tested and swept on a CPU without compiling.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, Mapping

NAMES = ("Config", "Shape", "config_for", "candidates", "compile", "variants_for", "workload")


def missing(module: ModuleType) -> list[str]:
    """The contract names `module` does not define."""
    return [n for n in NAMES if not hasattr(module, n)]


def shape_with(shape: Any, overrides: Mapping[str, Any]) -> Any:
    """`shape` with some fields replaced (e.g. from `sip-tune --shape k=v,...`); unknown keys, values
    of another kind and sizes below 1 are errors that name the key."""
    known = {f.name for f in dataclasses.fields(shape)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown shape keys {unknown}; {type(shape).__name__} takes {sorted(known)}")
    for name, value in overrides.items():
        current = getattr(shape, name)
        if current is not None and not _same_kind(value, current):
            raise ValueError(f"shape key {name}={value!r}: expected a {type(current).__name__}")
        if type(current) is int and value < 1:  # every int field of a Shape is a size or a count
            raise ValueError(f"shape key {name}={value!r}: sizes are at least 1")
    return dataclasses.replace(shape, **overrides)


def _same_kind(value: Any, current: Any) -> bool:
    """Whether `value` may replace `current` (an int where a float is expected, never a bool for a number)."""
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(current))


def bucket(shape: Any) -> Any:
    """`shape` with each of its class's SIZE_FIELDS raised to the next power of two (0 and 1 stay):
    the shapes one tuned-config entry serves. Every other field (heads, dims, dtype, options) is
    kept exactly, since it changes what the kernel computes, not only how much."""
    return dataclasses.replace(shape, **{name: _next_pow2(getattr(shape, name)) for name in type(shape).SIZE_FIELDS})


def _next_pow2(n: int) -> int:
    return n if n <= 1 else 1 << (int(n) - 1).bit_length()
