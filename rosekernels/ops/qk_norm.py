"""qk_norm(): Qwen3's per-head RMSNorm of q and k in one launch, optionally followed by the rotary embedding (the
kernel: rosekernels/kernels/qk_norm.py).

validate -> config (qk_norm_plan.config_for, or the tuned store's) -> compile -> plan -> launch: the
first call with an argument signature does all of it; later ones only test the addresses of given
outputs for overlaps and launch.
"""
from __future__ import annotations

import torch

from rosekernels import checks, launch, modes, tuned
from rosekernels.kernels import qk_norm as kernel
from rosekernels.kernels.qk_norm_plan import DTYPES, HEAD_DIMS, OP, QKNormShape, config_for


# ---------------------------------------------------------------------------------------------
# Argument checks (the slow path: first call per shape, and after any launch failure).

def _validate(q, k, q_weight, k_weight, out_q, out_k, cos=None, sin=None) -> None:
    named = {"q": q, "k": k, "q_weight": q_weight, "k_weight": k_weight}
    for name, t in (("out_q", out_q), ("out_k", out_k), ("cos", cos), ("sin", sin)):
        if t is not None:
            named[name] = t
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin go together: give both for the rotary embedding, or neither")
    checks.check_dtype("q", q, DTYPES)
    for name in ("k", "out_q", "out_k"):
        if name in named:
            checks.check_dtype(name, named[name], (q.dtype,))
    checks.check_dtype("q_weight", q_weight, dict.fromkeys((q.dtype, torch.float32)))
    checks.check_dtype("k_weight", k_weight, (q_weight.dtype,))
    checks.check_shape("q", q, (None, None, None))
    tokens, q_heads, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; expected one of {HEAD_DIMS}")
    checks.check_shape("k", k, (tokens, None, head_dim))
    if q_heads < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k need at least one head, got shapes {list(q.shape)} and {list(k.shape)}")
    checks.check_shape("q_weight", q_weight, (head_dim,))
    checks.check_shape("k_weight", k_weight, (head_dim,))
    if out_q is not None:
        checks.check_shape("out_q", out_q, tuple(q.shape))
    if out_k is not None:
        checks.check_shape("out_k", out_k, tuple(k.shape))
    if cos is not None:  # a row of head_dim values per token, in q's dtype or fp32, the same for both
        checks.check_dtype("cos", cos, dict.fromkeys((q.dtype, torch.float32)))
        checks.check_dtype("sin", sin, (cos.dtype,))
        checks.check_shape("cos", cos, (tokens, head_dim))
        checks.check_shape("sin", sin, (tokens, head_dim))
    tensors = (q, k, q_weight, k_weight, out_q, out_k, cos, sin)
    _disjoint(*tensors).check(*tensors)
    checks.check_vectors(named, [name for name in ("out_q", "out_k") if name in named])


def _disjoint(q, k, q_weight, k_weight, out_q, out_k, cos=None, sin=None) -> checks.Disjoint:
    """The outputs may share memory with no input and not with each other, but for the in-place forms: out_q
    q, out_k k."""
    return checks.Disjoint(dict(q=q, k=k, q_weight=q_weight, k_weight=k_weight, out_q=out_q, out_k=out_k, cos=cos,
                                sin=sin), ("out_q", "out_k"), {"out_q": "q", "out_k": "k"})


# ---------------------------------------------------------------------------------------------
# The op.

_plans = launch.PlanCache()


def _new_plan(q, k, q_weight, k_weight, out_q, out_k, eps, weight_bias, enable_pdl, cos,
              sin) -> tuple[launch.Launch, checks.Disjoint]:
    """Slow path, once per signature: validate everything, pick and load the kernel; the overlap test of
    the signature's later calls."""
    _validate(q, k, q_weight, k_weight, out_q, out_k, cos, sin)
    disjoint = _disjoint(q, k, q_weight, k_weight, out_q, out_k, cos, sin)
    if q.shape[0] == 0:
        return launch.nothing(q.device.index), disjoint
    shape = QKNormShape.of(q, k, q_weight, eps, weight_bias, enable_pdl, cos)
    sms = modes.sm_count(q.device.index)
    config = tuned.tuned_config(kernel, shape, config_for(shape, sms), sms)
    return launch.Launch(kernel.compile(config).fn, q.device.index), disjoint


def _run(q, k, q_weight, k_weight, out_q, out_k, eps, weight_bias, enable_pdl=True, cos=None, sin=None,
         given=True) -> None:
    # What the plan depends on, and the strides, which decide whether an output's elements overlap one
    # another (check_not_expanded) and the spans the overlap test below compares: the compiled host code
    # checks the other dtypes and shapes, the alignment and the devices on each call, not these.
    key = (q.shape, q.stride(), k.shape, k.stride(), q.dtype, q_weight.dtype, q.get_device(), eps, weight_bias,
           enable_pdl, out_q.stride(), out_k.stride(),
           None if cos is None else (cos.dtype, cos.stride(), None if sin is None else sin.stride()))
    plan, disjoint = _plans.get(key) or _plans.put(key, _new_plan(q, k, q_weight, k_weight, out_q, out_k, eps,
                                                                  weight_bias, enable_pdl, cos, sin))
    # given: whether the caller gave an output (fresh ones overlap nothing); the addresses decide the rest.
    if given and disjoint.clash(q, k, q_weight, k_weight, out_q, out_k, cos, sin):
        _validate(q, k, q_weight, k_weight, out_q, out_k, cos, sin)  # raises, saying which
    try:
        plan.launch(q, k, q_weight, k_weight, out_q, out_k, cos, sin)
    except Exception:
        # The compiled host code raises before launching; the full checks say what is wrong.
        _validate(q, k, q_weight, k_weight, out_q, out_k, cos, sin)
        raise


launch.register_op(OP, _run, mutates_args=("out_q", "out_k"),
                   schema="(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor(a!) out_q, Tensor(b!) out_k, "
                          "float eps, float weight_bias, bool enable_pdl=True, Tensor? cos=None, "
                          "Tensor? sin=None) -> ()")


def qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor | None = None,
            eps: float = 1e-6, weight_bias: float = 0.0, out_q: torch.Tensor | None = None,
            out_k: torch.Tensor | None = None, enable_pdl: bool = True, *, cos: torch.Tensor | None = None,
            sin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, hq, d] and k [T, hk, d] (d in 64/128/256) in one launch, then, given cos
    and sin, the rotary embedding.

    `y = x * rsqrt(mean(x^2) + eps) * (w + weight_bias)` with fp32 math; with cos and sin ([T, d], each
    token's rotary row, in q's dtype or fp32) `y * cos + rotate_half(y) * sin`, rotate_half(y) =
    (-y[d/2:], y[:d/2]): transformers' apply_rotary_pos_emb on the normed heads, in the same fp32
    registers, rounded once. q/k may be strided views
    (e.g. of a fused qkv buffer); weights are [d] in the input dtype or fp32, one for both
    (`qk_norm(q, k, w)`) or one each. Results go to out_q/out_k (new tensors by default; out_q=q,
    out_k=k normalizes in place; no other output may share memory with an input or the other output:
    rows of one buffer that interleave, as q and k of a fused qkv, do not). enable_pdl: launch with
    programmatic dependent launch (the kernel may start while the previous one in the stream finishes
    and waits for it before its loads; the next kernel may launch early): a microsecond less per launch
    in CUDA graphs.

    Eager calls launch the kernel directly (torch.library dispatch would add several us of host
    time per call); under torch.compile the call goes through the custom op rosekernels::qk_norm.
    """
    if k_weight is None:
        k_weight = q_weight
    given = out_q is not None or out_k is not None
    if out_q is None:
        out_q = torch.empty_like(q)
    if out_k is None:
        out_k = torch.empty_like(k)
    # The inputs decide (each tensor checked costs host time on every call): a tensor subclass given
    # only as a weight or an output is refused by the compiled host checks.
    tables = all(t is None or isinstance(t, torch.Tensor) for t in (cos, sin))  # (the plan's key reads them)
    if tables and launch.eager(q, k):
        _run(q, k, q_weight, k_weight, out_q, out_k, eps, weight_bias, bool(enable_pdl), cos, sin, given)
    elif tables and all(isinstance(t, torch.Tensor) for t in (q, k, q_weight, k_weight, out_q, out_k)):
        # traced, fake, meta
        torch.ops.rosekernels.qk_norm(q, k, q_weight, k_weight, out_q, out_k, eps, weight_bias, bool(enable_pdl),
                                      cos, sin)
    else:
        _validate(q, k, q_weight, k_weight, out_q, out_k, cos, sin)  # raises, naming the argument that is not a tensor
    return out_q, out_k
