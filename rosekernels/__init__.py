"""rosekernels: CuTeDSL kernels for LLM inference on Hopper (sm_90a).

Ops (torch tensors in, torch tensors out; each JIT-specialized per shape, dtype and warp count):

    qk_norm(q, k, q_weight, k_weight=None, eps, cos=None, sin=None)
                                                   Qwen3 per-head RMSNorm of q and k in one launch,
                                                   then the rotary embedding given its cos / sin rows
    rmsnorm(x, weight, eps, residual=None)         RMSNorm of rows, optionally fused with a residual add
    moe_dispatch(x, topk_ids, num_experts)         group tokens by expert for a grouped GEMM (MoE, one GPU;
                                                   local_experts=(first, count): a tensor-parallel rank's share)
    moe_combine(expert_out, topk_weights, slot_map)
                                                   weighted sum of each token's expert outputs
    moe_route(logits, topk, renormalize)           a router's softmax and top-k experts in one launch
                                                   (topk_weights, topk_ids int32: moe_dispatch's ids)
    gemm(a, w, bias, activation, gated)            act(a @ w.T + bias), act none/relu/leaky_relu/silu/gelu_tanh;
                                                   gated: act(a @ w_gate.T) * (a @ w_up.T) (SwiGLU), one kernel
    gate_up_rows(w_gate, w_up)                     the interleaved weight a gated gemm takes
    quantize_fp8(x, group_size=None | 128)         rows to e4m3 with fp32 scales per row or per 1 x 128 group
    quantize_weight_fp8(w, scheme)                 a weight to e4m3 once: per tensor, per channel, 128 x 128 blocks
    gemm_fp8(a, a_scale, w, w_scale, bias, activation, gated)
                                                   act((a @ w.T) * scales + bias), e4m3 a and w (per-tensor,
                                                   per-token x per-channel or 128 x 128 block scales), one kernel
    grouped_gemm(a, w, group_offsets, ...)         rows grouped by expert times each expert's weight w[e]
                                                   (moe_dispatch's layout; bias, activation, gated SwiGLU,
                                                   a_index gather, row_scale), one kernel, graph-capturable
    moe_experts(x, w_gate_up, w_down, topk_ids, topk_weights)
                                                   a routed-experts block, [T, H] -> [T, H]: dispatch, the
                                                   gate-up and down grouped GEMMs, combine
    gemm_leakyrelu(a, b, negative_slope, bias)     leaky_relu(a @ b.T + bias), prefill and decode kernels
    attention(q, k, v, causal)                     attention forward, GQA; S_q <= 16 runs the split-KV kernel
    attention_decode(q, k, v, causal, splits)      attention forced onto the split-KV (decode) kernel
    attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)
                                                   decode attention over a KV cache (contiguous or paged,
                                                   per-sequence lengths on the device; graph-capturable)
    append_kvcache(k_cache, v_cache, k, v, cache_seqlens, block_table)
                                                   write a step's new keys and values into that cache at each
                                                   sequence's length (in place, one launch, no sync)
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
                                                   prefill attention over packed sequences of different
                                                   lengths (cumulative lengths on the device)
    warmup(specs=(), model=None)                   compile what a model (or a list of specs) needs ahead of
                                                   the first call, and load SIP-tuned cubins

`help(rosekernels.qk_norm)` and so on give each op's arguments. The ops load on first use (importing
CuTeDSL takes seconds); `dir(rosekernels)` lists them without loading anything.

torch.ops.rosekernels.* are the out-variant custom ops behind them (qk_norm, rmsnorm, moe_dispatch,
moe_combine, moe_route, gemm, gemm_leakyrelu, quantize_fp8, gemm_fp8, grouped_gemm, attention_fwd,
attention_decode, attention_with_kvcache, attention_varlen_fwd, append_kvcache): they write into output
tensors the caller passes and return nothing. torch.compile and CUDA-graph capture go through them; eager
calls of the functions above skip the torch dispatcher. Call the functions above, not the custom ops.
"""
import os

# Before anything imports cutlass: unset, CuTeDSL silently targets sm_100a.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
del os  # dir(rosekernels) lists the package's own names only

# The public ops and the module of rosekernels.ops that defines each. warmup lives in `startup`: a
# submodule named `warmup` would shadow the function once imported.
_OP_MODULES = {"qk_norm": "qk_norm", "rmsnorm": "rmsnorm", "moe_dispatch": "moe_dispatch",
               "moe_combine": "moe_combine", "moe_route": "moe_route", "gemm": "gemm", "gemm_leakyrelu": "gemm", "gate_up_rows": "gemm",
               "quantize_fp8": "quantize", "quantize_weight_fp8": "quantize", "gemm_fp8": "gemm_fp8",
               "grouped_gemm": "grouped_gemm", "moe_experts": "moe_experts",
               "attention": "attention", "attention_decode": "attention", "attention_with_kvcache": "kvcache",
               "attention_varlen": "varlen", "append_kvcache": "append_kvcache"}
_EXPORTS = {**{name: f"rosekernels.ops.{module}" for name, module in _OP_MODULES.items()},
            "warmup": "rosekernels.startup"}
_MODULES = {"moe": "rosekernels.ops.moe"}  # multi-GPU MoE (ExpertParallel, TensorParallel): a module
# Names for kernel developers: the kernel modules by name (rosekernels.kernels.KERNELS, where they are
# looked up: below the ops, so that no lookup imports this package's face).
_DATA = {"KERNELS": "rosekernels.kernels"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    import importlib  # here, not at the top: dir(rosekernels) lists the package's own names only

    # Lazy public names: importing an op loads CuTeDSL (seconds), so each loads on first use. The
    # targets are the registries above, which tests/test_layers.py follows in its import graph.
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _DATA:
        value = getattr(importlib.import_module(_DATA[name]), name)
    else:
        raise AttributeError(f"module 'rosekernels' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    # The lazy names are not module attributes until first used: list them anyway.
    return sorted(set(globals()) | set(__all__) | set(_MODULES) | set(_DATA))
