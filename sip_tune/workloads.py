"""What sip-tune runs for a kernel of the package: one builder over the kernel-module contract.

    factory("qk_norm", "decode", {"tokens": 4})  ->  a picklable zero-argument callable -> Workload

The shape is the kernel's `Shape.defaults(mode)` with the `--shape` overrides; the config is the one
the op would pick for it (`config_for`), and must be of the mode asked for; the kernel module's
`workload(config, shape)` does the rest (inputs, outputs, reference check, launch). The factory is
called in the parent (which compiles) and again in the GPU worker (which loads from the disk cache).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

from rosekernels import contract
from rosekernels.kernels import kernel_module
from rosekernels.workload import Workload


def resolve(kernel: str, mode: str, shape: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """(config, shape) that tuning `kernel` in `mode` at the `shape` overrides means; ValueError with
    a hint when the shape selects the other mode's config."""
    m = kernel_module(kernel)
    full = contract.shape_with(m.Shape.defaults(mode), dict(shape or {}))
    config = m.config_for(full)
    got = config.variant().mode
    if got != mode:
        raise ValueError(f"{kernel}: shape {dataclasses.asdict(full)} selects the {got} variant, not {mode}; "
                         f"pass --mode {got} or another size")
    return config, full


def build(kernel: str, mode: str, shape: Mapping[str, Any] | None = None) -> Workload:
    """The Workload tuning `kernel` in `mode` at `shape` (compiles, or loads from the disk cache)."""
    config, full = resolve(kernel, mode, shape)
    workload = kernel_module(kernel).workload(config, full)
    return dataclasses.replace(workload, name=kernel)  # the tuned store files entries by kernel name


def factory(kernel: str, mode: str, shape: Mapping[str, Any] | None = None) -> Callable[[], Workload]:
    """`build` with these arguments, picklable (the Runner sends it to its worker process)."""
    return functools.partial(build, kernel, mode, dict(shape or {}))
