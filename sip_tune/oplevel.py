"""Op-level verification: a tuned config or cubin re-timed through the PUBLIC op, reached the way a
user reaches it, before sip-tune stores it (and by benchmarks that report what tuning buys).

    retime("gemm_leakyrelu", shape, ConfigCandidate(config, heuristic, original_sha256))  -> OpTiming
    retime("qk_norm", shape, CubinCandidate(variant, original, tuned))                     -> OpTiming

`shape` is the kernel module's Shape the candidate was tuned at. The measurement runs in a fresh
process (this module's `main`, started by `retime`), on the GPU:

1. A tuned store of its own (a temporary root) holds the candidate: the config entry, or the cubin
   entry beside the config entries of `store_root` that meet the store's bar (those a user's op
   would follow to the tuned cubin's config). The process's environment points the store there and
   the compile cache at this process's (nothing compiles twice).
2. The op as it runs without the candidate (the heuristic's config; the original cubin) is captured
   twice: the A/A pair, whose ratio says how far two identical arms measure apart. The op must
   launch what the candidate was tuned against there: the config it compiles is the candidate's
   heuristic (launch policy included), or its call loads the candidate's variant.
3. The candidate is loaded as a user loads it: `rosekernels.warmup(..., store_root=<that root>,
   allow_unverified=True)` (the entry cannot meet the bar before this measurement). The process then
   checks that the op reaches it, asking the op (which derives its shape from its arguments), not
   the store: the config the op's call compiles is the candidate's, or its call loads the tuned
   cubin for the candidate's variant. Otherwise it reports an error and measures nothing.
4. The op with the candidate, and every peer in reach (GEMM: cuBLAS through torch + the activation;
   attention: torch's SDPA, FA4 if importable; norms: quack if importable; otherwise none), are
   captured too.

Every arm is a CUDA graph of many calls cycling over input sets (inputs and weights, fresh tensors
each) that together hold more than ROTATE_BYTES, so no call finds its operands in L2, as a model's
forward pass reads each layer's weights once; the graphs are replayed interleaved (the order rotated
each round) and each arm's time is the median over rounds of its ratio to the first heuristic graph
replayed in the same round. speedup = heuristic / candidate; aa_spread = |A/A ratio - 1|; the peer
reported is the fastest one, its ratio peer time / candidate time.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from sip_tune import probe

ROTATE_BYTES = 64 << 20  # distinct input bytes per graph cycle, at least (H100/H200 L2: 50 MB) ...
L2_MULTIPLE = 2  # ... and at least this many L2 caches of the device
MAX_RING_BYTES = 4 << 30  # input sets held at once, at most
ROUNDS = 60
TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class ConfigCandidate:
    """A level-1 result: `config` to serve the shape's bucket where the heuristic picks `heuristic`,
    whose cubin hashes to `original_sha256`."""
    config: Any
    heuristic: Any
    original_sha256: str


@dataclasses.dataclass(frozen=True)
class CubinCandidate:
    """A level-2 result: `tuned` in place of the cubin `original` of `variant` (a jit.Variant)."""
    variant: Any
    original: bytes
    tuned: bytes


@dataclasses.dataclass
class OpTiming:
    """What the fresh process measured (per call, microseconds; error says why nothing was)."""
    kernel: str
    op: str = ""  # the public op timed, e.g. "rosekernels.gemm_leakyrelu"
    shape: dict = dataclasses.field(default_factory=dict)
    candidate: str = ""  # "config" or "cubin"
    gpu: str = ""
    heuristic_us: float = math.nan  # the op without the candidate (the heuristic's config / original cubin)
    tuned_us: float = math.nan
    speedup: float = math.nan  # heuristic_us / tuned_us, as the median of per-round ratios
    aa_spread: float = math.nan
    peer: str = "none"  # the fastest peer timed, or "none"
    peer_us: float = math.nan
    vs_peer: float = math.nan  # peer time / candidate time (> 1: the tuned op is faster)
    peers_us: dict = dataclasses.field(default_factory=dict)
    peer_errors: dict = dataclasses.field(default_factory=dict)  # peers in reach that failed to run
    rounds: int = 0
    launches_per_graph: int = 0
    input_sets: int = 0
    bytes_per_cycle: int = 0  # distinct input bytes one replay of a graph reads
    error: str = ""

    def passes(self, min_speedup: float) -> bool:
        """Measured, and past both `min_speedup` and 1 + the A/A spread."""
        return not self.error and self.speedup > max(min_speedup, 1 + self.aa_spread)

    def meta(self) -> dict[str, Any]:
        """The record the tuned store keeps (meta["checks"]["op_level"])."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "kernel" and (v or k != "peer_errors")}

    def text(self) -> str:
        if self.error:
            return f"op level: {self.error}"
        peer = (f"; {self.peer} {self.peer_us:.3f} us ({self.vs_peer:.3f}x)" if self.peer != "none"
                else "; no peer in reach")
        return (f"op level ({self.op}, fresh process, {self.input_sets} input sets = "
                f"{self.bytes_per_cycle / 2**20:.0f} MiB per cycle): heuristic {self.heuristic_us:.3f} us, tuned "
                f"{self.tuned_us:.3f} us: {self.speedup:.4f}x (A/A {self.aa_spread:.4f}){peer}")


def retime(kernel: str, shape: Any, candidate: ConfigCandidate | CubinCandidate, *,
           store_root: str | os.PathLike | None = None, rounds: int = ROUNDS,
           timeout_s: float = TIMEOUT_S) -> OpTiming:
    """Time `kernel`'s public op at `shape` with and without `candidate` in a fresh process (the
    module docstring). store_root: the tuned store whose verified config entries the op follows
    to a cubin candidate's config (None: `paths.tuned_store_root()`)."""
    if kernel not in CASES:
        return OpTiming(kernel, shape=_asdict(shape), error=f"no op-level case for {kernel!r}")
    result = _in_fresh_process(kernel, shape, candidate, store_root, rounds, False, timeout_s)
    return OpTiming(**result) if "kernel" in result else OpTiming(kernel, shape=_asdict(shape), **result)


def check_setup(kernel: str, shape: Any, candidate: ConfigCandidate | CubinCandidate, *,
                store_root: str | os.PathLike | None = None, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The fresh process's set-up alone, no launch (no GPU needed): {"store", "compile_cache",
    "allow_env": what its environment held, "reached": whether the op's store lookup gives it the
    candidate, "problem": why not}, or {"error"} if the process failed."""
    return _in_fresh_process(kernel, shape, candidate, store_root, ROUNDS, True, timeout_s)


def _in_fresh_process(kernel: str, shape: Any, candidate: ConfigCandidate | CubinCandidate, store_root: Any,
                      rounds: int, dry_run: bool, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sip-oplevel-") as tmp:
        work = Path(tmp)
        request = prepare(kernel, shape, candidate, work, store_root, rounds, dry_run)
        out = work / "result.json"
        text, code = probe.run_isolated(probe.python_command(__name__, str(request), str(out)), timeout_s,
                                        env=child_env(work))
        if code != 0 or not out.is_file():
            last = [line for line in text.strip().splitlines() if line.strip()][-3:]
            return {"error": f"the op-level process failed (exit {code}): " + " | ".join(last)}
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# The fresh process's set-up (CPU).

@dataclasses.dataclass(frozen=True)
class _Request:
    kernel: str
    shape: Any
    candidate: ConfigCandidate | CubinCandidate
    store: str  # the temporary store root holding the candidate
    empty: str  # a root with no entries: the op without a tuned config
    rounds: int
    dry_run: bool


def prepare(kernel: str, shape: Any, candidate: ConfigCandidate | CubinCandidate, work: Path,
            store_root: str | os.PathLike | None = None, rounds: int = ROUNDS, dry_run: bool = False) -> Path:
    """Write the fresh process's tuned store (under work/store) and request (work/request.pkl); the
    request's path. The candidate's entry records what it is; it has no checks yet."""
    from rosekernels import tuned
    from rosekernels.kernels import kernel_module

    store, empty = work / "store", work / "empty"
    empty.mkdir(parents=True, exist_ok=True)
    meta = {"speedup": 0.0, "purpose": "an op-level candidate of sip_tune.oplevel, not yet verified"}
    if isinstance(candidate, ConfigCandidate):
        tuned.store_config(store, kernel_module(kernel), shape, candidate.config, candidate.heuristic,
                           candidate.original_sha256, meta, keep_better=False)
    else:
        # stored under the variant's kernel, where warmup looks (attention_varlen's is attention's)
        tuned.store(store, candidate.variant.op, candidate.variant, candidate.original, candidate.tuned, meta,
                    keep_better=False)
        for entry in tuned.config_entries(store_root, kernel_module(candidate.variant.op)):
            if not entry.problems:  # what a user's op follows to the tuned cubin's config
                target = store / entry.path.relative_to(entry.path.parents[3])
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(entry.path, target)
    request = work / "request.pkl"
    request.write_bytes(pickle.dumps(_Request(kernel, shape, candidate, str(store), str(empty), rounds, dry_run)))
    return request


def child_env(work: Path) -> dict[str, str | None]:
    """What the fresh process's environment changes: the store is the temporary one, the compile
    cache this process's; entries below the bar stay refused until the candidate is loaded."""
    from rosekernels import paths, tuned

    return {paths.TUNED_STORE_ENV: str(work / "store"), paths.COMPILE_CACHE_ENV: str(paths.compile_cache_root()),
            tuned.ALLOW_ENV: None}


# ---------------------------------------------------------------------------------------------
# The public ops, per kernel: input sets at a shape, the call, the peers.

@dataclasses.dataclass
class Case:
    """`kernel`'s public op at one shape. make_set(seed, device): one set of the op's arguments
    (fresh random inputs and weights; the last `outputs` entries are output buffers); call(set):
    the op; peers: name -> a factory of another implementation's call (ImportError: not in reach)."""
    op: str
    make_set: Callable[[int, str], tuple]
    call: Callable[[tuple], Any]
    outputs: int = 0
    peers: dict[str, Callable[[], Callable[[tuple], Any]]] = dataclasses.field(default_factory=dict)

    def input_bytes(self, args: tuple) -> int:
        """Device bytes of a set's inputs and weights, each storage once (outputs are not read)."""
        import torch

        seen = {}
        for t in args[:len(args) - self.outputs]:
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _gen(seed: int, device: str) -> Any:
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def _gemm(shape: Any) -> Case:
    import torch
    import torch.nn.functional as F

    import rosekernels

    m, n, k, dt = shape.m, shape.n, shape.k, _dtype(shape.dtype)
    layout = "nk" if shape.b_major == "k" else "kn"

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        a = torch.randn(m, k, generator=g, device=device).to(dt)
        w = torch.randn(n, k, generator=g, device=device).div_(k ** 0.5).to(dt)  # [N, K], as nn.Linear
        bias = None if shape.bias == "none" else torch.randn(n, generator=g, device=device).to(_dtype(shape.bias))
        out = torch.empty(m, n // 2 if shape.gated else n, dtype=dt, device=device)
        # the op's weight in its layout; the peer's bias in a's dtype (cuBLAS takes no other)
        return (a, w if layout == "nk" else w.t().contiguous(), bias, None if bias is None else bias.to(dt), out)

    if shape.activation == "leaky_relu" and not shape.gated:
        op = "rosekernels.gemm_leakyrelu"

        def call(s: tuple) -> None:
            rosekernels.gemm_leakyrelu(s[0], s[1], shape.slope, s[2], out=s[4], b_layout=layout, enable_pdl=shape.pdl)
    else:
        op = "rosekernels.gemm"

        def call(s: tuple) -> None:
            rosekernels.gemm(s[0], s[1], s[2], None if shape.activation == "none" else shape.activation, shape.gated,
                             shape.slope, out=s[4], b_layout=layout, enable_pdl=shape.pdl)

    act = {"none": lambda y: y, "relu": lambda y: F.relu(y, inplace=True),
           "leaky_relu": lambda y: F.leaky_relu(y, shape.slope, inplace=True),
           "silu": lambda y: F.silu(y, inplace=True), "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}[
        shape.activation]

    def cublas() -> Callable[[tuple], Any]:
        def run(s: tuple) -> Any:
            y = F.linear(s[0], s[1] if layout == "nk" else s[1].t(), s[3])
            if not shape.gated:
                return act(y)
            blocks = y.view(m, n // 16, 2, 8)  # gate and up rows interleaved in blocks of 8 (rosekernels.gemm)
            return (act(blocks[:, :, 0]) * blocks[:, :, 1]).view(m, n // 2)
        return run

    return Case(op, make_set, call, outputs=1, peers={f"cublas+{shape.activation}": cublas})


def _gemm_fp8(shape: Any) -> Case:
    """e4m3 a and w quantized as the shape's scales say (rowcol: per token and per channel; block: 1 x 128
    and 128 x 128); the peer: torch._scaled_mm (cuBLASLt FP8, rowwise scales) and the epilogue in torch."""
    import torch
    import torch.nn.functional as F

    import rosekernels
    from rosekernels.kernels.gemm_fp8 import random_operands

    m, n, k, out_dt = shape.m, shape.n, shape.k, _dtype(shape.dtype)
    activation = None if shape.activation == "none" else shape.activation

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        a, a_scale, w, w_scale = random_operands(m, n, k, shape.scales, g, device)
        bias = None if shape.bias == "none" else torch.randn(n, generator=g, device=device).to(_dtype(shape.bias))
        return a, a_scale, w, w_scale, bias, torch.empty(m, n // 2 if shape.gated else n, dtype=out_dt, device=device)

    def call(s: tuple) -> None:
        rosekernels.gemm_fp8(*s[:5], activation=activation, gated=shape.gated, negative_slope=shape.slope, out=s[5],
                             enable_pdl=shape.pdl)

    act = {"none": lambda y: y, "relu": F.relu, "leaky_relu": lambda y: F.leaky_relu(y, shape.slope), "silu": F.silu,
           "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}[shape.activation]

    def scaled_mm() -> Callable[[tuple], Any]:
        if shape.scales != "rowcol" or not hasattr(torch, "_scaled_mm"):
            raise ImportError("torch._scaled_mm takes per-tensor and rowwise scales here")

        def run(s: tuple) -> Any:
            y = torch._scaled_mm(s[0], s[2].t(), s[1].view(m, 1), s[3].view(1, n), out_dtype=out_dt)
            y = y + s[4] if s[4] is not None else y
            if not shape.gated:
                return act(y)
            blocks = y.view(m, n // 16, 2, 8)  # gate and up rows interleaved in blocks of 8 (rosekernels.gemm)
            return (act(blocks[:, :, 0]) * blocks[:, :, 1]).reshape(m, n // 2)
        return run

    return Case("rosekernels.gemm_fp8", make_set, call, outputs=1, peers={"torch._scaled_mm": scaled_mm})


def _attention_inputs(batch: int, s_q: int, s_kv: int, hq: int, hkv: int, d: int, dt: Any) -> Callable:
    import torch

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        q = torch.randn(batch, s_q, hq, d, generator=g, device=device).to(dt)
        k, v = (torch.randn(batch, s_kv, hkv, d, generator=g, device=device).to(dt) for _ in "kv")
        return q, k, v, torch.empty_like(q)
    return make_set


def _attention_peers(s_q: int, s_kv: int, hq: int, hkv: int, causal: bool) -> dict[str, Callable]:
    def sdpa() -> Callable[[tuple], Any]:
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        # rosekernels aligns the causal mask bottom-right; SDPA's is_causal aligns it top-left
        mask = causal_lower_right(s_q, s_kv) if causal and s_q != s_kv else None
        return lambda s: F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in s[:3]), attn_mask=mask, is_causal=causal and mask is None,
            enable_gqa=hq != hkv)

    def fa4() -> Callable[[tuple], Any]:
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        from flash_attn.cute.interface import flash_attn_func

        return lambda s: flash_attn_func(*s[:3], causal=causal)

    return {"sdpa": sdpa, "fa4": fa4}


def _attention(shape: Any) -> Case:
    import rosekernels

    make_set = _attention_inputs(shape.batch, shape.seqlen, shape.seqlen, shape.heads_q, shape.heads_kv,
                                 shape.head_dim, _dtype(shape.dtype))
    return Case("rosekernels.attention", make_set, lambda s: rosekernels.attention(*s[:3], shape.causal, out=s[3]),
                outputs=1, peers=_attention_peers(shape.seqlen, shape.seqlen, shape.heads_q, shape.heads_kv,
                                                  shape.causal))


def _attention_decode(shape: Any) -> Case:
    """The split-KV kernel's shapes (S_q <= 16): `rosekernels.attention` takes it for them."""
    import rosekernels

    make_set = _attention_inputs(shape.batch, shape.seqlen_q, shape.seqlen_kv, shape.heads_q, shape.heads_kv,
                                 shape.head_dim, _dtype(shape.dtype))

    def call(s: tuple) -> None:
        rosekernels.attention(*s[:3], shape.causal, out=s[3], enable_pdl=shape.pdl)

    return Case("rosekernels.attention", make_set, call, outputs=1,
                peers=_attention_peers(shape.seqlen_q, shape.seqlen_kv, shape.heads_q, shape.heads_kv, shape.causal))


@dataclasses.dataclass(frozen=True)
class VarlenShape:
    """Packed self-attention sequences for `rosekernels.attention_varlen` (its kernel has no Shape of
    the kernel contract: a launch takes cumulative lengths, not sizes)."""
    head_dim: int
    causal: bool
    lengths: tuple[int, ...]
    heads: int = 16
    dtype: str = "bf16"


def _attention_varlen(shape: VarlenShape) -> Case:
    import itertools

    import torch

    import rosekernels

    total, longest = sum(shape.lengths), max(shape.lengths)

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        q, k, v = (torch.randn(total, shape.heads, shape.head_dim, generator=g, device=device).to(_dtype(shape.dtype))
                   for _ in "qkv")
        cu = torch.tensor([0, *itertools.accumulate(shape.lengths)], dtype=torch.int32, device=device)
        return q, k, v, cu, torch.empty_like(q)

    def call(s: tuple) -> None:
        rosekernels.attention_varlen(*s[:3], s[3], s[3], longest, longest, shape.causal, out=s[4])

    def fa4() -> Callable[[tuple], Any]:
        os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
        from flash_attn.cute.interface import flash_attn_varlen_func

        return lambda s: flash_attn_varlen_func(*s[:3], cu_seqlens_q=s[3], cu_seqlens_k=s[3], max_seqlen_q=longest,
                                                max_seqlen_k=longest, causal=shape.causal)

    return Case("rosekernels.attention_varlen", make_set, call, outputs=1, peers={"fa4": fa4})


def _qk_norm(shape: Any) -> Case:
    import torch

    import rosekernels

    dt, d = _dtype(shape.dtype), shape.head_dim
    wdt = _dtype(shape.weight_dtype or shape.dtype)

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        q = torch.randn(shape.tokens, shape.q_heads, d, generator=g, device=device).mul_(3).to(dt)
        k = torch.randn(shape.tokens, shape.k_heads, d, generator=g, device=device).mul_(3).to(dt)
        wq, wk = (torch.randn(d, generator=g, device=device).mul_(0.2).add_(1).to(wdt) for _ in "qk")
        tables = ()
        if shape.rope:  # each token's rotary cos and sin rows
            angles = torch.rand(shape.tokens, d, generator=g, device=device).mul_(2 * math.pi)
            tables = (angles.cos().to(_dtype(shape.rope)), angles.sin().to(_dtype(shape.rope)))
        return q, k, wq, wk, *tables, torch.empty_like(q), torch.empty_like(k)  # (the outputs last)

    def call(s: tuple) -> None:
        rosekernels.qk_norm(*s[:4], eps=shape.eps, weight_bias=shape.weight_bias, out_q=s[-2], out_k=s[-1],
                            enable_pdl=shape.pdl, **dict(zip(("cos", "sin"), s[4:-2])))

    def quack() -> Callable[[tuple], Any]:
        if shape.weight_bias or shape.rope:
            raise ImportError("quack's rmsnorm has no weight bias or rotary embedding")
        from quack.rmsnorm import rmsnorm_fwd

        return lambda s: (rmsnorm_fwd(s[0].view(-1, d), s[2], eps=shape.eps)[0],
                          rmsnorm_fwd(s[1].view(-1, d), s[3], eps=shape.eps)[0])

    return Case("rosekernels.qk_norm", make_set, call, outputs=2, peers={"quack": quack})


def _rmsnorm(shape: Any) -> Case:
    import torch

    import rosekernels

    dt, wdt = _dtype(shape.dtype), _dtype(shape.weight_dtype or shape.dtype)
    fp8 = shape.fp8 != "none"  # the output in e4m3, with its scales
    group = 128 if shape.fp8 == "group" else None

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        x = torch.randn(shape.rows, shape.hidden, generator=g, device=device).to(dt)
        w = torch.randn(shape.hidden, generator=g, device=device).mul_(0.2).add_(1).to(wdt)
        r = torch.randn(shape.rows, shape.hidden, generator=g, device=device).to(dt) if shape.residual else None
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else dt, device=device)
        scales = None
        if fp8:
            scales = torch.empty((shape.rows, shape.hidden // group) if group else (shape.rows,), device=device)
        return x, w, r, out, torch.empty_like(x) if shape.residual else None, scales

    def call(s: tuple) -> None:
        rosekernels.rmsnorm(s[0], s[1], shape.eps, residual=s[2], out=s[3], residual_out=s[4], enable_pdl=shape.pdl,
                            fp8=fp8, group_size=group, scales=s[5])

    def quack() -> Callable[[tuple], Any]:
        from quack.rmsnorm import rmsnorm_fwd

        return lambda s: rmsnorm_fwd(s[0], s[1], residual=s[2], eps=shape.eps)

    return Case("rosekernels.rmsnorm", make_set, call, outputs=3, peers={} if fp8 else {"quack": quack})


def _quantize_fp8(shape: Any) -> Case:
    """Rows of bf16/fp16/fp32 to e4m3 with their scales; the peer: the same quantization in torch."""
    import torch

    import rosekernels

    group = shape.group or None

    def make_set(seed: int, device: str) -> tuple:
        x = torch.randn(shape.rows, shape.hidden, generator=_gen(seed, device), device=device).to(_dtype(shape.dtype))
        scales = (shape.rows, shape.hidden // shape.group) if shape.group else (shape.rows,)
        return (x, torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(scales, dtype=torch.float32, device=device))

    def call(s: tuple) -> None:
        rosekernels.quantize_fp8(s[0], group, out=s[1], scales=s[2], enable_pdl=shape.pdl)

    def torch_peer() -> Callable[[tuple], Any]:
        from rosekernels.fp8 import quantize

        return lambda s: quantize(s[0], 1, group)

    return Case("rosekernels.quantize_fp8", make_set, call, outputs=2, peers={"torch": torch_peer})


def _moe_dispatch(shape: Any) -> Case:
    import torch

    import rosekernels

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        x = torch.randn(shape.tokens, shape.hidden, generator=g, device=device).to(_dtype(shape.dtype))
        scores = torch.rand(shape.tokens, shape.experts, generator=g, device=device)
        return x, scores.topk(shape.topk, dim=1).indices.to(torch.int32)  # distinct experts per token

    return Case("rosekernels.moe_dispatch", make_set, lambda s: rosekernels.moe_dispatch(s[0], s[1], shape.experts))


def _moe_combine(shape: Any) -> Case:
    import torch

    import rosekernels

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        rows = shape.tokens * shape.topk
        expert_out = torch.randn(rows, shape.hidden, generator=g, device=device).to(_dtype(shape.dtype))
        slots = torch.randperm(rows, generator=g, device=device).view(shape.tokens, shape.topk).to(torch.int32)
        weights = torch.rand(shape.tokens, shape.topk, generator=g, device=device).softmax(1)
        out = torch.empty(shape.tokens, shape.hidden, dtype=expert_out.dtype, device=device)
        return expert_out, weights.to(_dtype(shape.weight_dtype)), slots, out

    return Case("rosekernels.moe_combine", make_set, lambda s: rosekernels.moe_combine(*s[:3], out=s[3]), outputs=1)


def _moe_route(shape: Any) -> Case:
    """Router logits of the shape's dtype; the peer: transformers' router ops after the GEMM (softmax in fp32,
    torch.topk, the division by the chosen sum, the cast)."""
    import torch

    import rosekernels

    wdt = _dtype(shape.weight_dtype)

    def make_set(seed: int, device: str) -> tuple:
        logits = torch.randn(shape.tokens, shape.experts, generator=_gen(seed, device), device=device)
        return (logits.to(_dtype(shape.dtype)), torch.empty(shape.tokens, shape.topk, dtype=wdt, device=device),
                torch.empty(shape.tokens, shape.topk, dtype=torch.int32, device=device))

    def call(s: tuple) -> None:
        rosekernels.moe_route(s[0], shape.topk, shape.renormalize, topk_weights=s[1], topk_ids=s[2],
                              enable_pdl=shape.pdl)

    def torch_peer() -> Callable[[tuple], Any]:
        def run(s: tuple) -> Any:
            top, ids = torch.topk(torch.softmax(s[0], dim=-1, dtype=torch.float), shape.topk, dim=-1)
            return (top / top.sum(-1, keepdim=True) if shape.renormalize else top).to(wdt), ids
        return run

    return Case("rosekernels.moe_route", make_set, call, outputs=2, peers={"torch": torch_peer})


def _grouped_gemm(shape: Any) -> Case:
    """Rows of a random routing (each row to a uniform expert) grouped as moe_dispatch groups them; the
    peer: torch._grouped_mm (its sm_90 kernel: bf16, no bias, no gather) and the epilogue in torch."""
    import torch
    import torch.nn.functional as F

    import rosekernels

    dt, rows, experts, n, k = _dtype(shape.dtype), shape.rows, shape.experts, shape.n, shape.k
    tokens = max(1, rows // 2) if shape.gather else rows
    activation = None if shape.activation == "none" else shape.activation

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        a = torch.randn(tokens, k, generator=g, device=device).to(dt)
        w = torch.randn(experts, n, k, generator=g, device=device).div_(k ** 0.5).to(dt)
        counts = torch.bincount(torch.randint(experts, (rows,), generator=g, device=device), minlength=experts)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        bias = None if shape.bias == "none" else torch.randn(experts, n, generator=g, device=device).to(
            _dtype(shape.bias))
        index = torch.randint(tokens, (rows,), generator=g, device=device, dtype=torch.int32) if shape.gather else None
        scale = torch.rand(rows, generator=g, device=device) if shape.row_scale else None
        out = torch.empty(rows, n // 2 if shape.gated else n, dtype=dt, device=device)
        return a, w, offsets, bias, index, scale, out

    def call(s: tuple) -> None:
        rosekernels.grouped_gemm(s[0], s[1], s[2], bias=s[3], activation=activation, gated=shape.gated,
                                 negative_slope=shape.slope, a_index=s[4], row_scale=s[5], out=s[6],
                                 enable_pdl=shape.pdl)

    act = {"none": lambda y: y, "relu": F.relu, "leaky_relu": lambda y: F.leaky_relu(y, shape.slope), "silu": F.silu,
           "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}[shape.activation]

    def grouped_mm() -> Callable[[tuple], Any]:
        if getattr(torch, "_grouped_mm", None) is None or dt != torch.bfloat16 or shape.bias != "none" or \
                shape.gather:
            raise ImportError("torch._grouped_mm takes bf16 rows without bias or gather")

        def run(s: tuple) -> Any:
            y = torch._grouped_mm(s[0], s[1].transpose(-2, -1), offs=s[2][1:])
            y = act(y[:, :n // 2]) * y[:, n // 2:] if shape.gated else act(y)
            return y * s[5][:, None] if shape.row_scale else y
        return run

    return Case("rosekernels.grouped_gemm", make_set, call, outputs=1, peers={"torch._grouped_mm": grouped_mm})


def _append_kvcache(shape: Any) -> Case:
    """A decode step or prefill chunk of `batch` sequences written at random lengths that fit (the
    caches are read-modify-write: they count as inputs)."""
    import torch

    import rosekernels

    block = 16
    blocks = -(-(shape.new_tokens + 64) // block)

    def make_set(seed: int, device: str) -> tuple:
        g = _gen(seed, device)
        dt, b, heads, d = _dtype(shape.dtype), shape.batch, shape.kv_heads, shape.head_dim
        cache = (b * blocks, block, heads, d) if shape.paged else (b, blocks * block, heads, d)
        cache_dt = torch.float8_e4m3fn if shape.fp8 else dt  # an e4m3 cache: k and v quantized on the way in
        k_cache, v_cache = (torch.randn(*cache, generator=g, device=device).to(cache_dt) for _ in "kv")
        k, v = (torch.randn(b, shape.new_tokens, heads, d, generator=g, device=device).to(dt) for _ in "kv")
        lengths = torch.randint(0, blocks * block - shape.new_tokens + 1, (b,), generator=g, device=device,
                                dtype=torch.int32)
        table = (torch.randperm(b * blocks, generator=g, device=device).view(b, blocks).to(torch.int32)
                 if shape.paged else None)
        descales = tuple(torch.rand(heads, generator=g, device=device) + 0.5 for _ in "kv") if shape.fp8 else ()
        return (k_cache, v_cache, k, v, lengths, table, *descales)

    return Case("rosekernels.append_kvcache", make_set, lambda s: rosekernels.append_kvcache(*s))


CASES: dict[str, Callable[[Any], Case]] = {
    "gemm_leakyrelu": _gemm, "attention": _attention, "attention_decode": _attention_decode, "qk_norm": _qk_norm,
    "rmsnorm": _rmsnorm, "moe_dispatch": _moe_dispatch, "moe_combine": _moe_combine,
    "append_kvcache": _append_kvcache, "attention_varlen": _attention_varlen, "grouped_gemm": _grouped_gemm,
    "quantize_fp8": _quantize_fp8, "gemm_fp8": _gemm_fp8, "moe_route": _moe_route}


def ring_sets(set_bytes: int, l2_bytes: int) -> int:
    """Input sets to cycle over: together more than ROTATE_BYTES and L2_MULTIPLE L2 caches, at least
    two (consecutive calls never share inputs), at most MAX_RING_BYTES of them."""
    set_bytes = max(set_bytes, 1)
    return max(2, min(max(ROTATE_BYTES, L2_MULTIPLE * l2_bytes) // set_bytes + 1, MAX_RING_BYTES // set_bytes))


# ---------------------------------------------------------------------------------------------
# The fresh process.

def main(argv: list[str]) -> int:
    request: _Request = pickle.loads(Path(argv[0]).read_bytes())
    result = _dry_run(request) if request.dry_run else _measure(request)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


def _load_candidate(request: _Request) -> str:
    """Load the candidate from the temporary store as a user would (warmup, opted in: it cannot meet
    the bar yet); '' if the store gives it at the tuned shape, else why not. (Whether the op, which
    derives its shape from its arguments, launches it is `_measure`'s question: `_planned_configs`.)"""
    import rosekernels
    from rosekernels import tuned
    from rosekernels.kernels import kernel_module

    cand = request.candidate
    if isinstance(cand, ConfigCandidate):
        rosekernels.warmup([cand.heuristic], store_root=request.store, allow_unverified=True, progress=False,
                           shipped=False)  # the candidate alone, not a shipped entry of the same original
        module = kernel_module(request.kernel)
        if module.config_for(request.shape) != cand.heuristic:
            return "the op's heuristic at this shape is not the config the candidate was tuned against"
        got = tuned.tuned_config(module, request.shape, cand.heuristic)
        return "" if got == cand.config else f"the tuned store gives the op {got}, not the candidate"
    report = rosekernels.warmup([cand.variant], store_root=request.store, allow_unverified=True, progress=False,
                                shipped=False)
    return "" if cand.variant.key() in report.tuned else f"warmup did not load the tuned cubin: {report}"


def _dry_run(request: _Request) -> dict[str, Any]:
    """The set-up without a launch (CPU tests): where the store is, and whether the candidate is reached."""
    from rosekernels import paths, tuned

    problem = _load_candidate(request)
    return {"store": os.environ.get(paths.TUNED_STORE_ENV), "compile_cache": str(paths.compile_cache_root()),
            "allow_env": os.environ.get(tuned.ALLOW_ENV), "reached": not problem, "problem": problem}


class _OpBench:
    """Input sets past L2 and CUDA graphs of calls over them (sip_tune.runner's capture and replay)."""

    def __init__(self, case: Case):
        import torch

        from sip_tune import runner

        self.case, self.timer = case, runner.GraphTimer()
        self.timer.torch, self.timer.stream = torch, torch.cuda.Stream()
        self.gpu, l2 = runner.device_info()
        first = case.make_set(0x5EED, "cuda")
        self.set_bytes = case.input_bytes(first)
        self.ring = [first] + [case.make_set(0x5EED + i, "cuda") for i in range(1, ring_sets(self.set_bytes, l2))]
        self.launches = min(len(self.ring), 32)
        t = statistics.median(self.timer._replay([self.graph(case.call)], 5)[0]) / self.launches
        # every set once per replay at least: the bytes a cycle reads are the whole ring's
        self.launches = max(len(self.ring), runner.launches_per_graph(t, len(self.ring), runner.Options()))

    def graph(self, call: Callable[[tuple], Any]) -> Any:
        """`launches` calls cycling over the input sets, in one CUDA graph."""
        call(self.ring[0])  # outside the capture: plans, loads and allocates

        def body() -> None:
            for j in range(self.launches):
                call(self.ring[j % len(self.ring)])
        return self.timer._capture(body)

    def replay(self, graphs: list[Any], rounds: int) -> list[tuple[float, float]]:
        """(median us per call, median over rounds of the time / graphs[0]'s) of each graph,
        replayed interleaved."""
        times = self.timer._replay(graphs, rounds)
        return [(statistics.median(row) / self.launches * 1e3, statistics.median(t / b for b, t in zip(times[0], row)))
                for row in times]


def _planned(call: Callable[[], Any]) -> list[Any]:
    """The kernels `call` (the op, planned afresh) loads."""
    from rosekernels import jit, launch

    jit.forget_loaded()
    launch.forget_plans()
    call()
    return jit.loaded_variants()


def _planned_configs(module: Any, call: Callable[[], Any]) -> list[Any]:
    """The configs of `module`'s kernel that `call` (the op, planned afresh) compiles, launch policy
    included: what it launches (every op compiles through its kernel module's `compile`)."""
    from rosekernels import launch

    seen: list[Any] = []
    compile_config = module.compile
    module.compile = lambda config: seen.append(config) or compile_config(config)
    try:
        launch.forget_plans()
        call()
    finally:
        module.compile = compile_config
    return seen


def _measure(request: _Request) -> dict[str, Any]:
    import torch

    from rosekernels import jit, paths
    from rosekernels.kernels import kernel_module

    case, cand = CASES[request.kernel](request.shape), request.candidate
    cubin = isinstance(cand, CubinCandidate)
    out = OpTiming(request.kernel, case.op, _asdict(request.shape), "cubin" if cubin else "config",
                   rounds=request.rounds)
    # The op without the candidate: no tuned config (a config candidate), or the store's verified
    # configs with the original cubin (a cubin candidate: no tuned cubin is installed yet).
    paths.use_tuned_store_root(request.store if cubin else request.empty)
    bench = _OpBench(case)
    out.gpu, out.input_sets = bench.gpu, len(bench.ring)
    out.launches_per_graph, out.bytes_per_cycle = bench.launches, len(bench.ring) * bench.set_bytes
    once = lambda: case.call(bench.ring[0])  # noqa: E731
    # What the op launches, asked of the op (it derives its shape from its arguments): the arms
    # must be the heuristic the candidate was tuned against and the candidate, or nothing is measured.
    module = None if cubin else kernel_module(request.kernel)
    if cubin and not any(k.variant == cand.variant for k in _planned(once)):
        out.error = f"the op does not launch {cand.variant.key()} at this shape"
        return dataclasses.asdict(out)
    if not cubin and cand.heuristic not in (planned := _planned_configs(module, once)):
        out.error = (f"the op plans {planned} at this shape, not the heuristic the candidate was tuned against "
                     f"({cand.heuristic})")
        return dataclasses.asdict(out)
    graphs = [bench.graph(case.call), bench.graph(case.call)]  # the A/A pair
    keep = jit.loaded_variants()  # what those graphs launch: loaded until they have been replayed
    problem = _load_candidate(request)
    if not problem and cubin and not any(k.variant == cand.variant and k.tuned for k in _planned(once)):
        problem = f"the op does not load the tuned cubin of {cand.variant.key()} at this shape"
    if not problem and not cubin and cand.config not in (planned := _planned_configs(module, once)):
        problem = f"the op plans {planned} at this shape, not the candidate {cand.config}"
    if problem:
        out.error = problem
        return dataclasses.asdict(out)
    graphs.append(bench.graph(case.call))
    peers = []
    for name, factory in case.peers.items():
        try:
            graphs.append(bench.graph(factory()))
            peers.append(name)
        except Exception as e:  # noqa: BLE001 - a peer out of reach (not installed, cannot be captured)
            torch.cuda.synchronize()
            out.peer_errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    timed = bench.replay(graphs, request.rounds)
    del keep
    out.heuristic_us, out.tuned_us = timed[0][0], timed[2][0]
    out.aa_spread, out.speedup = abs(timed[1][1] - 1), 1 / timed[2][1]
    out.peers_us = {name: us for name, (us, _) in zip(peers, timed[3:])}
    if peers:
        best = min(range(len(peers)), key=lambda i: timed[3 + i][1])
        out.peer, out.peer_us = peers[best], timed[3 + best][0]
        out.vs_peer = timed[3 + best][1] / timed[2][1]
    return dataclasses.asdict(out)


def _asdict(shape: Any) -> dict:
    return dataclasses.asdict(shape) if dataclasses.is_dataclass(shape) else dict(shape)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
