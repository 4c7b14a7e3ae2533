"""moe_dispatch(): group the tokens by expert for a grouped GEMM, in one launch (the kernel, the buffer's
layout and what the counters mean: rosekernels/kernels/moe_dispatch.py).

validate -> config (the mode by T*k, or the tuned store's) -> compile -> plan -> launch: the first call
with an argument signature does all of it; later ones check the pointers (alignment, overlap) and
launch.
"""
from __future__ import annotations

from typing import Any

import torch

from rosekernels import checks, launch, modes, scratch, tuned
from rosekernels.kernels import moe_dispatch as kernel
from rosekernels.kernels.moe_common import DTYPES, MoeDispatch, check_sm90, rows_view
from rosekernels.kernels.moe_dispatch_plan import (
    DEFAULT_BLOCK_SIZE, OP, DispatchConfig, DispatchShape, choose_mode, default_capacity, expert_range, meta_layout,
    num_ctas)


def moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, capacity: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, *, buffer: torch.Tensor | None = None,
                 mode: str | None = None, check: bool = False,
                 local_experts: tuple[int, int] | None = None) -> MoeDispatch:
    """Group the tokens of x [T, H] by expert: see the module docstring for the layout.

    topk_ids [T, k] int32 (-1 = not routed). `capacity` (rows of the buffer) defaults to the worst case
    `default_capacity(...)`; pass `buffer` [capacity, H] to reuse one (overlapping neither x nor
    topk_ids; its rows outside the experts' stored tokens are left as they were). `mode` forces
    "prefill" or "decode" (default: by T*k).

    Nothing is raised on the device: ids outside [-1, E) make the whole dispatch a no-op (counted in
    `.invalid`), and pairs past the capacity are dropped (slot -1, counted in `.overflow`). Call
    `.check()` on the result to turn either into an exception, or pass `check=True` (a debug switch:
    it synchronises with the device on every call, so not inside CUDA graphs).

    local_experts=(first, count) (tensor parallel: this rank's experts) groups only the pairs routed to
    experts first .. first + count - 1 of the num_experts: the buffer, counts and offsets hold those
    `count` experts (index e - first), the other pairs get slot -1 and are neither dropped nor invalid.

    Registered as torch.ops.rosekernels.moe_dispatch (mutating `buffer`) for torch.compile and fake
    tensors; eager calls skip the torch dispatcher and reuse the launch plan validated for the same
    shapes, strides, dtypes and devices (tens of microseconds less per call).
    """
    first, count = expert_range(num_experts, local_experts)
    if local_experts is not None:
        local_experts = (first, count)  # a checked tuple: part of the plan's key
    given = buffer is not None
    if not given:
        if not (isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2):
            raise ValueError("topk_ids must be a 2-D tensor [tokens, k]")
        num_tokens, topk = topk_ids.shape
        if capacity is None:
            capacity = default_capacity(num_tokens, topk, count, block_size)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D tensor [tokens, hidden]")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        buffer = x.new_empty((capacity, x.shape[1]))
    elif capacity is not None and capacity != buffer.shape[0]:
        raise ValueError(f"capacity {capacity} disagrees with the buffer's {buffer.shape[0]} rows")
    if launch.eager(x, topk_ids, buffer):
        slot_map, meta = _run(x, topk_ids, buffer, num_experts, block_size, mode, local_experts, given=given)
    else:
        slot_map, meta = _call_op(x, topk_ids, buffer, num_experts, block_size, mode, local_experts)
    result = MoeDispatch(buffer, slot_map, meta, num_experts)
    if check:
        result.check()
    return result


def _call_op(x: Any, topk_ids: Any, buffer: Any, num_experts: int, block_size: int,
             mode: str | None, local_experts: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Through the registered op: traced (torch.compile), fake/meta tensors, tensor subclasses."""
    if mode is None:
        if not (isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2):
            raise ValueError("topk_ids must be a 2-D tensor [tokens, k]")
        mode = choose_mode(*topk_ids.shape)
    first, count = local_experts or (0, 0)  # the op's count 0: every expert
    return torch.ops.rosekernels.moe_dispatch(x, topk_ids, buffer, num_experts, block_size, mode, first, count)


class _Plan(launch.Launch):
    """A dispatch validated for one signature: beyond the kernel and its device, the block size, the
    grid, the size of `meta`, whether it takes the prefill scratch, and whether some tensor needs
    `rows_view` (a size-1 dim with an odd stride); `disjoint`: the buffer's overlap test."""

    def __init__(self, fn: Any, device: torch.device, cfg: DispatchConfig, block_size: int, grid: int,
                 canonical: bool, disjoint: checks.Disjoint):
        super().__init__(fn, device.index)
        self.torch_device = device
        self.prefill = cfg.mode == "prefill"
        self.block_size = block_size
        self.grid = grid
        self.meta_size = meta_layout(cfg.num_experts)["size"]
        self.canonical = canonical
        self.disjoint = disjoint

    def launch(self, x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor,
               private_scratch: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_map, meta): the outputs, the scratch and the launch on the plan's device and its stream."""
        return launch.on_device(self.device, self._launch, x, topk_ids, buffer, private_scratch)

    def _launch(self, x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor,
                private_scratch: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.canonical:
            x, topk_ids, buffer = rows_view(x), rows_view(topk_ids), rows_view(buffer)
        slot_map = torch.empty(topk_ids.shape, dtype=torch.int32, device=self.torch_device)
        meta = torch.empty(self.meta_size, dtype=torch.int32, device=self.torch_device)
        ws = scratch.zeroed_int32(self.device, kernel.WS_INTS, private_scratch) if self.prefill else None
        self.fn(x, topk_ids, buffer, slot_map, meta, ws, self.block_size, self.grid)
        return slot_map, meta


_plans = launch.PlanCache()


def _run(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor, num_experts: int, block_size: int,
         mode: str | None, local_experts: tuple[int, int] | None = None,
         private_scratch: bool = False, given: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on plain tensors. Per call: the plan's key, the pointer checks (of the buffer only if `given`:
    an allocated one is aligned and overlaps nothing), the two outputs, the launch; the first call with a
    key validates everything and compiles or loads the kernel."""
    # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
    key = (x.shape, x.stride(), x.dtype, x.get_device(), topk_ids.shape, topk_ids.stride(), topk_ids.dtype,
           topk_ids.get_device(), buffer.shape, buffer.stride(), buffer.dtype, buffer.get_device(),
           num_experts, block_size, mode, local_experts)
    plan = _plans.get(key) or _plans.put(key, _new_plan(x, topk_ids, buffer, num_experts, block_size, mode,
                                                        local_experts))
    if x.data_ptr() % 16 or given and (buffer.data_ptr() % 16 or plan.disjoint.clash(x, topk_ids, buffer)):
        _check_pointers(x, topk_ids, buffer)  # raises, saying which
    return plan.launch(x, topk_ids, buffer, private_scratch)


def _new_plan(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor, num_experts: int,
              block_size: int, mode: str | None, local_experts: tuple[int, int] | None) -> _Plan:
    """The slow path, once per signature: every check, the config, the kernel compiled or loaded, the grid."""
    views = rows_view(x), rows_view(topk_ids), rows_view(buffer)
    cfg = validate(*views, num_experts, block_size, mode or choose_mode(*topk_ids.shape), local_experts)
    if not cfg.ranged:  # the tuned store holds whole-range dispatches only
        cfg = tuned.tuned_config(kernel, DispatchShape.of(x, topk_ids, num_experts), cfg)
    canonical = any(v.stride() != t.stride() for v, t in zip(views, (x, topk_ids, buffer)))
    grid = num_ctas(cfg, x.shape[0], modes.sm_count(x.device.index))
    return _Plan(kernel.compile(cfg).fn, x.device, cfg, block_size, grid, canonical, _disjoint(x, topk_ids, buffer))


def _disjoint(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor) -> checks.Disjoint:
    """The buffer may share memory with no input: the copy would read tokens that other threads already
    overwrote."""
    return checks.Disjoint(dict(x=x, topk_ids=topk_ids, buffer=buffer), ("buffer",), {})


def _check_pointers(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """What a plan's key does not cover: 16-byte alignment, the buffer overlapping an input."""
    checks.check_aligned("x", x)
    checks.check_aligned("buffer", buffer)
    _disjoint(x, topk_ids, buffer).check(x, topk_ids, buffer)


def validate(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor, num_experts: int,
             block_size: int, mode: str, local_experts: tuple[int, int] | None = None, *,
             on_device: bool = True) -> DispatchConfig:
    """Every argument check, in the order shapes/types -> device -> alignment, so that each one can be
    exercised with CPU or meta tensors; returns the kernel's config."""
    for name, t in (("x", x), ("topk_ids", topk_ids), ("buffer", buffer)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("x", x, DTYPES)
    checks.check_dtype("topk_ids", topk_ids, (torch.int32,))
    checks.check_dtype("buffer", buffer, (x.dtype,))
    checks.check_shape("x", x, (None, None))
    checks.check_shape("topk_ids", topk_ids, (x.shape[0], None))
    checks.check_shape("buffer", buffer, (None, x.shape[1]))
    if not isinstance(num_experts, (int, torch.SymInt)) or isinstance(num_experts, bool):
        raise ValueError(f"num_experts must be an int, got {num_experts!r}")
    first, count = expert_range(num_experts, local_experts)
    cfg = DispatchConfig(checks.DTYPE_NAME[x.dtype], x.shape[1], count, topk_ids.shape[1], mode,
                         expert_first=first, experts_total=num_experts if count != num_experts else 0)
    if not isinstance(block_size, (int, torch.SymInt)) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    tokens, topk, capacity = x.shape[0], topk_ids.shape[1], buffer.shape[0]
    if mode == "decode" and tokens * topk > cfg.decode_pairs_limit:
        raise ValueError(f"the decode variant routes at most {cfg.decode_pairs_limit} (token, choice) pairs, "
                         f"got {tokens} x {topk}; use mode='prefill'")
    worst = tokens * topk + min(count, tokens * topk) * (block_size - 1)
    if max(worst, capacity, tokens * (x.shape[1] // cfg.vec)) + checks.INDEX_SLACK >= 2**31:
        raise ValueError("sizes exceed the kernel's 32-bit row/element indexing: "
                         f"T={tokens}, k={topk}, E={num_experts}, block_size={block_size}, capacity={capacity}")
    if on_device:
        for name, t in (("x", x), ("topk_ids", topk_ids), ("buffer", buffer)):
            checks.check_cuda(name, t)
        checks.check_same_device(x=x, topk_ids=topk_ids, buffer=buffer)
        check_sm90(x.device)
        for name, t in (("x", x), ("topk_ids", topk_ids), ("buffer", buffer)):
            checks.check_unit_last_stride(name, t)
        _check_pointers(x, topk_ids, buffer)
        checks.check_not_expanded("buffer", buffer)
    return cfg


def _impl(x: torch.Tensor, topk_ids: torch.Tensor, buffer: torch.Tensor, num_experts: int, block_size: int,
          variant_mode: str, expert_first: int, expert_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    # (not `mode`: torch's functionalization of mutating ops passes a `mode` keyword of its own)
    # A private scratch per launch: compiled graphs (see rosekernels.scratch). expert_count 0: every expert.
    local = (expert_first, expert_count) if expert_count else None
    return _run(x, topk_ids, buffer, num_experts, block_size, variant_mode, local, private_scratch=True)


def _fake(x, topk_ids, buffer, num_experts, block_size, variant_mode, expert_first, expert_count):
    cfg = validate(x, topk_ids, buffer, num_experts, block_size, variant_mode,
                   (expert_first, expert_count) if expert_count else None, on_device=False)
    return (topk_ids.new_empty(topk_ids.shape, dtype=torch.int32),
            topk_ids.new_empty((meta_layout(cfg.num_experts)["size"],), dtype=torch.int32))


launch.register_op(OP, _impl, mutates_args=("buffer",), fake=_fake)
