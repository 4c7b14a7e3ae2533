"""The one launch layer every op goes through.

An op reads: validate -> config -> compile -> plan -> launch. The first call with an argument
signature (shapes, strides, dtypes, devices and the scalar options) validates everything, picks the
config, loads the compiled kernel and keeps what the signature decides in a plan (`PlanCache`); every
later call with that signature only does what depends on the data pointers and launches. Eager calls
on plain tensors skip the torch dispatcher (`eager`), which would add several microseconds to a
kernel that runs for one or two; traced calls (torch.compile, fake tensors, tensor subclasses) go
through the op registered with `register_op`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

PLAN_CACHE_SIZE = 4096
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (fake, functional) take the registered op


class PlanCache:
    """Launch plans by argument signature. Every op builds its key the same way: one flat tuple written
    out in the op (a generic builder looping over the arguments costs about a microsecond more per
    call) of what its plan depends on: each tensor's shape, strides, dtype and device index (None for
    an absent optional tensor), then the scalar options. Where the kernel's compiled host code checks
    strides, alignment and the agreement of sizes on every call, the key leaves out what those checks
    cover (qk_norm, rmsnorm, append_kvcache). Bounded: past `size` signatures (many distinct token
    counts) it starts over rather than grow without bound."""

    def __init__(self, size: int = PLAN_CACHE_SIZE):
        self.size = size
        self._plans: dict[tuple, Any] = {}
        self.get = self._plans.get  # the dict's own method: no Python frame on the per-call path
        _caches.append(self)

    def put(self, key: tuple, plan: Any) -> Any:
        if len(self._plans) >= self.size:
            self._plans.clear()
        self._plans[key] = plan
        return plan


_caches: list[PlanCache] = []  # every op's, for forget_plans()


def forget_plans() -> None:
    """Drop every op's plans: the next call of each signature plans again, e.g. after warm-up loaded
    tuned configs, which plans made before it do not see."""
    for cache in _caches:
        cache._plans.clear()


def eager(*tensors: Any) -> bool:
    """Whether a call may skip the dispatcher: every argument given is a plain tensor (None skipped),
    none is a meta tensor, and nothing is being traced."""
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return not torch.compiler.is_compiling()


def on_device(device: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with `device` current: TVM-FFI launches on the current device's current stream, so a
    call on tensors of another device switches to it for the launch."""
    if torch._C._cuda_getDevice() == device:
        return fn(*args)
    with torch.cuda.device(device):
        return fn(*args)


class Launch:
    """One kernel planned for one argument signature: the loaded kernel function and the device it
    runs on. Ops subclass it to keep what else the signature decides (grid, split count, views)."""

    def __init__(self, fn: Callable[..., Any], device: int):
        self.fn = fn
        self.device = device

    def launch(self, *args: Any) -> None:
        on_device(self.device, self.fn, *args)


def _nothing(*args: Any) -> None:
    return None


def nothing(device: int) -> Launch:
    """The plan of a call with nothing to compute (an empty batch)."""
    return Launch(_nothing, device)


def register_op(name: str, impl: Callable[..., Any], mutates_args: Iterable[str],
                fake: Callable[..., Any] | None = None, schema: str | None = None) -> Any:
    """`impl` as the custom op torch.ops.rosekernels.<name> (what torch.compile and CUDA-graph trees
    call), with `fake` as its shape function (default: returns None, for ops that only write their
    out arguments)."""
    op = torch.library.custom_op(f"rosekernels::{name}", impl, mutates_args=tuple(mutates_args), schema=schema)
    op.register_fake(fake or (lambda *args, **kwargs: None))
    return op
