"""moe_combine(): out[t] = sum_j w[t, j] * expert_out[slot_map[t, j]], the inverse of moe_dispatch (the
kernel: rosekernels/kernels/moe_combine.py).

validate -> config (the mode by T, or the tuned store's) -> compile -> plan -> launch: the first call
with an argument signature does all of it; later ones check the pointers (alignment, overlap) and
launch.
"""
from __future__ import annotations

from typing import Any

import torch

from rosekernels import checks, launch, tuned
from rosekernels.kernels import moe_combine as kernel
from rosekernels.kernels.moe_combine_plan import OP, CombineConfig, CombineShape, choose_mode
from rosekernels.kernels.moe_common import DTYPES, check_sm90, rows_view


def moe_combine(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
                out: torch.Tensor | None = None, *, mode: str | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_out[slot_map[t, j]] (fp32 accumulation), slots -1
    skipped; out [T, H] in expert_out's dtype (allocated if not given; it must not overlap an input).
    `mode` forces "prefill" or "decode" (default: by T).

    Registered as torch.ops.rosekernels.moe_combine (mutating `out`) for torch.compile and fake
    tensors; eager calls skip the torch dispatcher and reuse the launch plan validated for the same
    shapes, strides, dtypes and devices."""
    given = out is not None
    if not given:
        if not (isinstance(expert_out, torch.Tensor) and expert_out.dim() == 2
                and isinstance(slot_map, torch.Tensor) and slot_map.dim() == 2):
            raise ValueError("expert_out must be [rows, hidden] and slot_map [tokens, k]")
        out = expert_out.new_empty((slot_map.shape[0], expert_out.shape[1]))
    if launch.eager(expert_out, topk_weights, slot_map, out):
        _run(expert_out, topk_weights, slot_map, out, mode, given)
    else:
        _call_op(expert_out, topk_weights, slot_map, out, mode)
    return out


def _call_op(expert_out: Any, topk_weights: Any, slot_map: Any, out: Any, mode: str | None) -> None:
    """Through the registered op: traced (torch.compile), fake/meta tensors, tensor subclasses."""
    if mode is None:
        if not (isinstance(slot_map, torch.Tensor) and slot_map.dim() == 2):
            raise ValueError("slot_map must be a 2-D tensor [tokens, k]")
        mode = choose_mode(slot_map.shape[0])
    torch.ops.rosekernels.moe_combine(expert_out, topk_weights, slot_map, out, mode)


class _Plan(launch.Launch):
    """A combine validated for one signature; fn None: no tokens, nothing to launch. `canonical`: some
    tensor needs `rows_view` (a size-1 dim with an odd stride); `disjoint`: out's overlap test."""

    def __init__(self, fn: Any, device: int, canonical: bool, disjoint: checks.Disjoint):
        super().__init__(fn, device)
        self.canonical = canonical
        self.disjoint = disjoint

    def launch(self, expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
               out: torch.Tensor) -> None:
        if self.canonical:
            expert_out, topk_weights, slot_map, out = map(rows_view, (expert_out, topk_weights, slot_map, out))
        launch.on_device(self.device, self.fn, expert_out, topk_weights, slot_map, out)


_plans = launch.PlanCache()


def _run(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
         mode: str | None, given: bool = True) -> None:
    """Launch on plain tensors. Per call: the plan's key, the pointer checks (of out only if `given`: an
    allocated one is aligned and overlaps nothing), the launch; the first call with a key validates
    everything and compiles or loads the kernel."""
    # The plan's signature, written out: a generic builder (a loop over the arguments) costs ~1 us more.
    key = (expert_out.shape, expert_out.stride(), expert_out.dtype, expert_out.get_device(),
           topk_weights.shape, topk_weights.stride(), topk_weights.dtype, topk_weights.get_device(),
           slot_map.shape, slot_map.stride(), slot_map.dtype, slot_map.get_device(),
           out.shape, out.stride(), out.dtype, out.get_device(), mode)
    plan = _plans.get(key) or _plans.put(key, _new_plan(expert_out, topk_weights, slot_map, out, mode))
    if plan.fn is None:
        return
    if expert_out.data_ptr() % 16 or given and (
            out.data_ptr() % 16 or plan.disjoint.clash(expert_out, topk_weights, slot_map, out)):
        _check_pointers(expert_out, topk_weights, slot_map, out)  # raises, saying which
    plan.launch(expert_out, topk_weights, slot_map, out)


def _new_plan(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
              mode: str | None) -> _Plan:
    """The slow path, once per signature: every check, the config, the kernel compiled or loaded."""
    tensors = (expert_out, topk_weights, slot_map, out)
    views = tuple(map(rows_view, tensors))
    cfg = validate(*views, mode or choose_mode(slot_map.shape[0]))
    cfg = tuned.tuned_config(kernel, CombineShape.of(expert_out, topk_weights, slot_map), cfg)
    fn = kernel.compile(cfg).fn if out.numel() else None
    return _Plan(fn, out.device.index, any(v.stride() != t.stride() for v, t in zip(views, tensors)),
                 _disjoint(*tensors))


def _disjoint(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
              out: torch.Tensor) -> checks.Disjoint:
    """out may share memory with no input: the kernel would read rows that other threads already wrote."""
    return checks.Disjoint(dict(expert_out=expert_out, topk_weights=topk_weights, slot_map=slot_map, out=out),
                           ("out",), {})


def _check_pointers(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor,
                    out: torch.Tensor) -> None:
    """What a plan's key does not cover: 16-byte alignment, out overlapping an input."""
    checks.check_aligned("expert_out", expert_out)
    checks.check_aligned("out", out)
    _disjoint(expert_out, topk_weights, slot_map, out).check(expert_out, topk_weights, slot_map, out)


def validate(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
             mode: str, *, on_device: bool = True) -> CombineConfig:
    """Every argument check, shapes/types first, then device, then alignment; returns the config."""
    for name, t in (("expert_out", expert_out), ("topk_weights", topk_weights), ("slot_map", slot_map),
                    ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    checks.check_dtype("expert_out", expert_out, DTYPES)
    checks.check_dtype("topk_weights", topk_weights, (torch.float32, expert_out.dtype))
    checks.check_dtype("slot_map", slot_map, (torch.int32,))
    checks.check_dtype("out", out, (expert_out.dtype,))
    checks.check_shape("expert_out", expert_out, (None, None))
    checks.check_shape("slot_map", slot_map, (None, None))
    checks.check_shape("topk_weights", topk_weights, tuple(slot_map.shape))
    checks.check_shape("out", out, (slot_map.shape[0], expert_out.shape[1]))
    cfg = CombineConfig(checks.DTYPE_NAME[expert_out.dtype], checks.DTYPE_NAME[topk_weights.dtype],
                        expert_out.shape[1], slot_map.shape[1], mode)
    if max(expert_out.shape[0], out.shape[0] * (out.shape[1] // cfg.vec)) + checks.INDEX_SLACK >= 2**31:
        raise ValueError(f"sizes exceed the kernel's 32-bit indexing: expert_out {list(expert_out.shape)}, "
                         f"out {list(out.shape)}")
    if on_device:
        for name, t in (("expert_out", expert_out), ("topk_weights", topk_weights), ("slot_map", slot_map),
                        ("out", out)):
            checks.check_cuda(name, t)
        checks.check_same_device(expert_out=expert_out, topk_weights=topk_weights, slot_map=slot_map, out=out)
        check_sm90(out.device)
        for name, t in (("expert_out", expert_out), ("topk_weights", topk_weights), ("slot_map", slot_map),
                        ("out", out)):
            checks.check_unit_last_stride(name, t)
        _check_pointers(expert_out, topk_weights, slot_map, out)
        checks.check_not_expanded("out", out)
    return cfg


def _impl(expert_out: torch.Tensor, topk_weights: torch.Tensor, slot_map: torch.Tensor, out: torch.Tensor,
          variant_mode: str) -> None:
    # (not `mode`: torch's functionalization of mutating ops passes a `mode` keyword of its own)
    _run(expert_out, topk_weights, slot_map, out, variant_mode)


def _fake(expert_out, topk_weights, slot_map, out, variant_mode):
    validate(expert_out, topk_weights, slot_map, out, variant_mode, on_device=False)


launch.register_op(OP, _impl, mutates_args=("out",), fake=_fake)
