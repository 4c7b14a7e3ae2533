"""A compiled kernel and how to feed and check it: what each kernel module's `workload(config, shape)`
returns, for its tests and for the tuner (which runs it in a worker process on the GPU)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from rosekernels import jit


@dataclasses.dataclass
class Workload:
    """make_args(seed): ONE set of arguments of `kernel.fn` on the GPU for the shape being tuned,
        random data drawn from `seed`; output buffers poisoned (NaN for floats, a sentinel for
        integers) so that an element the kernel fails to write shows up. An integer argument that
        is all zero at launch is scratch (a tile or split counter, a barrier) that the kernel must
        leave zero, as the ops reuse it: the tuner checks that too (sip_tune.runner.launch_checked).
    test_args(seed): the same for testing; a compiled kernel serves every size of its mode, so this
        draws the sizes too (small and ragged ones). Default: make_args.
    outputs(args): after a launch, the tensors to compare between two kernels that must agree (in a
        canonical form where the kernel's output order is free).
    check(args): after a launch, raise AssertionError unless the outputs match the float64
        reference within the kernel's stated tolerance; returns the worst error.
    launch(fn, args): how to call a loaded kernel function (e.g. zero scratch first); default fn(*args).
    """

    kernel: "jit.CompiledKernel"
    make_args: Callable[[int], tuple]
    outputs: Callable[[tuple], Sequence[Any]]
    check: Callable[[tuple], float] | None = None
    test_args: Callable[[int], tuple] | None = None
    launch: Callable[[Callable[..., Any], tuple], None] | None = None
    name: str = ""

    def run(self, fn: Callable[..., Any], args: tuple) -> None:
        if self.launch is None:
            fn(*args)
        else:
            self.launch(fn, args)

    def sample(self, seed: int) -> tuple:
        return (self.test_args or self.make_args)(seed)
