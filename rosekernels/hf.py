"""Qwen3 and Qwen3-MoE in Hugging Face transformers (>= 5.17) on the rosekernels ops.

    import rosekernels.hf
    print(rosekernels.hf.warmup(model))  # optional: compile and load the kernels it launches up front
    rosekernels.hf.apply(model)          # patched in place and returned; idempotent
    print(rosekernels.hf.plan(model))    # what apply() replaces (works on CPU and meta models too)

What apply() replaces (the model on one sm_90 GPU):
- RMSNorm modules -> rosekernels.rmsnorm. In each decoder layer the residual add after attention is
  fused into post_attention_layernorm: one launch returns the normalized state and the new residual.
  The add after the MLP stays a torch add: the layer must return the full hidden state (the model's
  layer loop passes it on and output_hidden_states records it), so fusing it into the next layer's
  input_layernorm would mean replacing Qwen3Model.forward.
- q_norm + k_norm and the rotary embedding (transformers' apply_rotary_pos_emb: about ten torch launches)
  -> one rosekernels.qk_norm launch on [tokens, heads, head_dim] views of the q and k projections' outputs,
  with the layer's cos and sin rows.
- attention -> rosekernels.attention, registered as attn_implementation "rosekernels" in transformers'
  AttentionInterface (with `prefix_mask`, sdpa's mask function, in AttentionMaskInterface).
  transformers passes q as [B, Hq, S_q, d] and k/v as the KV cache holds them, [B, Hkv, S_kv, d]; the
  kernels take [B, S, H, d] with any 16-byte-aligned strides, so the transposed views go in without a
  copy. A static cache's
  decode steps (its mask covers the whole cache) run rosekernels.attention_with_kvcache with each
  sequence's key count taken from the mask on the device (`prefix_mask`), also inside CUDA graphs
  and inside a compiled forward whose masks were built before it (generate() builds them eagerly).
- the q, k and v projections -> one rosekernels.gemm over their weights' rows, concatenated (`qkv_weight`,
  built by apply(), which removes q_proj, k_proj and v_proj; their outputs are column slices of the one
  result, which qk_norm and the cache take as strided views). In decode, k and v alone are GEMMs too small
  to stream their weights at the copy rate; state_dict() and load_state_dict() keep the stock keys, as
  for the MLP below (host copies). The o projection -> rosekernels.gemm.
- the dense MLP (SwiGLU) -> two rosekernels.gemm launches: the gated GEMM, silu(x @ gate^T) * (x @ up^T) in
  one kernel, then the down projection. The gated GEMM takes the gate and up rows interleaved in blocks of 8
  in one weight: apply() builds it (`gate_up_weight`) and removes gate_proj and up_proj, so the weights are
  not held twice; state_dict() and load_state_dict() still read and write gate_proj.weight and
  up_proj.weight (hooks convert; state_dict's gate and up entries are host copies), so checkpoints stay
  interchangeable with the stock model. Projections that are not plain nn.Linear modules (LoRA,
  quantized layers, hooks) stay on their own forward.
- MoE experts, on one of two paths (`apply(model, experts=...)`, default EXPERTS_PATH), registered as
  experts_implementation "rosekernels" in transformers' ExpertsInterface:
  "grouped_mm": moe_dispatch (block size 1: no padding rows, so the grouped GEMMs only compute routed
  rows) -> torch._grouped_mm on the experts' gate_up and down weights (bf16 on sm_90: torch's CUTLASS
  grouped GEMM, no host synchronisation, capturable) -> SiLU-and-mul in torch -> moe_combine;
  "moe_experts": rosekernels.moe_experts on the weights as stored (dispatch, the gate-up grouped GEMM
  with SwiGLU in its epilogue, the down grouped GEMM, combine; bf16 and fp16): no torch GEMM left.
- the MoE router's softmax, top-k and renormalisation (4-6 torch launches) -> one rosekernels.moe_route after
  its GEMM, in the blocks whose experts are served (its int32 ids go to experts_forward, which hands any
  stock fallback int64 ones).
Left on torch: the rotary tables (once a forward), embedding, the MoE router's GEMM and lm_head.

`apply(model, fp8="tensor" | "channel" | "block")` also runs the linear layers in FP8: the q/k/v/o projections
(q, k and v as one weight where per-channel or 128-row block scales quantize it as the three apart: `qkv_fp8`)
and the dense MLP's (gate/up interleaved, then down) quantized once to e4m3 (rosekernels.quantize_weight_fp8:
per tensor, per output channel or per 128 x 128 block; the bf16 weights are dropped, so state_dict() holds
the e4m3 weights and their scales) and run on rosekernels.gemm_fp8. Their activations are quantized per token
(per 1 x 128 group with block-scaled weights): by the input and post-attention norms in the same launch
(rmsnorm's fp8 option) for the projections and the gate/up GEMM that follow them, by quantize_fp8 for o_proj
and down_proj. A MoE model's experts stay in bf16, and `fp8_exclude` keeps the blocks it names in bf16 (a
model's first layer, say, as FP8 checkpoints often leave it). Such a model runs on the GPU only. A model keeps
the scheme of the apply() that patched it: a later apply() with another fp8 (or with one after a bf16 apply())
is refused, as another experts path is. The KV cache stays what the caller passes; `Fp8StaticCache` (a
StaticCache in e4m3, quantized on the way in by append_kvcache) has decode steps read it with
attention_with_kvcache's e4m3 path.

A call rosekernels cannot serve runs the stock path instead and is counted in `stats()` as
"fallback:<op>:<reason>": attention with a mask tensor other than a static cache's decode mask
(padding; a static cache's prefill of more than 16 tokens; a mask built inside a compiled forward),
dropout, another dtype or head dim; experts in a dtype the path does not take (grouped_mm: bf16 only); GEMMs in fp32. Calls served
are counted under the op's name. Calls inside torch.compile are not counted (traced code would bake a Python
counter in as a constant): check those with torch.profiler kernel names.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

import rosekernels
from rosekernels import fp8 as fp8_math
from rosekernels.kernels import (append_kvcache_plan, attention_decode_plan, attention_plan, gemm_fp8_plan,
                                 gemm_leakyrelu_plan, grouped_gemm_plan, moe_combine_plan, moe_dispatch_plan,
                                 moe_route_plan, qk_norm_plan, quantize_fp8_plan, rmsnorm_plan)
from rosekernels.models import QWEN3_8B, QWEN3_30B_A3B, ModelDims

try:
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config, Qwen3MoeConfig
    from transformers.activations import SiLUActivation
    from transformers.cache_utils import StaticCache, StaticLayer
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    from transformers.models.qwen3 import modeling_qwen3 as q3
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3m
except ImportError as e:  # an optional extra
    raise ImportError(f"rosekernels.hf needs transformers 5.17 (pip install 'rosekernels[hf]'): {e}") from e

# The patched forwards follow the decoder layer and attention code of this transformers release; under
# 5.24 the patched model's cached decode no longer matched stock on the CPU, so other releases are refused.
TRANSFORMERS = "5.17."

IMPLEMENTATION = "rosekernels"  # its name in transformers' attention and experts registries
MODEL_TYPES = ("qwen3", "qwen3_moe")
# How apply() runs MoE experts unless told otherwise: "moe_experts" (rosekernels.moe_experts: the grouped
# GEMM kernels) or "grouped_mm" (torch._grouped_mm between the rosekernels dispatch and combine). On an H100
# moe_experts ran 1.09-1.46x grouped_mm's path in decode and 1.07-1.25x in prefill on the Qwen3-MoE
# geometries (bench/results/moe/moe_experts*.md), and it serves fp16 too.
EXPERTS_PATH = "moe_experts"
EXPERTS_WHAT = {"grouped_mm": "MoE experts -> moe_dispatch, torch._grouped_mm x2, moe_combine",
                "moe_experts": "MoE experts -> rosekernels.moe_experts (dispatch, gate-up grouped GEMM with SwiGLU, "
                               "down grouped GEMM, combine)"}

# ---------------------------------------------------------------------------------------------
# Counters: which path each call took.

_calls: collections.Counter = collections.Counter()


def stats() -> dict[str, int]:
    """Calls served by rosekernels per op, and "fallback:<op>:<reason>" calls that ran the stock path,
    since the last reset_stats() (eager calls and CUDA-graph captures; not calls inside torch.compile)."""
    return dict(_calls)


def reset_stats() -> None:
    _calls.clear()


def _count(key: str) -> None:
    if not torch.compiler.is_compiling():  # traced, a Python counter would be baked in as a constant
        _calls[key] += 1


# ---------------------------------------------------------------------------------------------
# The replacement forwards. Each is a mixin put in front of the stock class (RoseQwen3* below), so
# super().forward is the stock forward, isinstance checks still hold and a fallback is one call away.


class _RMSNorm:
    """forward(x) -> rosekernels.rmsnorm; forward(x, residual) -> (norm(x + residual), x + residual); with fp8
    ("row" or "group": the activations of FP8 linear layers) the norm in e4m3 and its scales first."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, fp8: str | None = None):
        w = self.weight
        if fp8 is not None:  # an FP8 model runs on the GPU only: the kernel's checks say so otherwise
            _count("rmsnorm+fp8" if residual is None else "rmsnorm+residual+fp8")
            return rosekernels.rmsnorm(hidden_states, w, eps=self.variance_epsilon, residual=residual, fp8=True,
                                       group_size=fp8_math.BLOCK if fp8 == "group" else None)
        if hidden_states.is_cuda and hidden_states.dtype in rmsnorm_plan.DTYPES and w.dtype in (
                hidden_states.dtype, torch.float32):
            _count("rmsnorm" if residual is None else "rmsnorm+residual")
            return rosekernels.rmsnorm(hidden_states, w, eps=self.variance_epsilon, residual=residual)
        _count("fallback:rmsnorm:" + ("device" if not hidden_states.is_cuda else "dtype"))
        if residual is None:
            return super().forward(hidden_states)
        hidden_states = residual + hidden_states
        return super().forward(hidden_states), hidden_states


def _normed_qk(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, hidden_shape: tuple, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple:
    """q_norm and k_norm of the projections q [..., Hq*d], k [..., Hk*d], then the rotary embedding by cos and
    sin ([B or 1, S, d]), as [B, H, S, d] views: all in one qk_norm launch where it takes them."""
    wq, wk = attn.q_norm.weight, attn.k_norm.weight
    refusal = _qk_norm_refusal(q, wq, wk)
    if refusal is not None:
        _count("fallback:qk_norm:" + refusal)
        qn, kn = attn.q_norm(q.view(hidden_shape)), attn.k_norm(k.view(hidden_shape))
        return attn._rope(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)
    _count("qk_norm")
    d, rows = attn.head_dim, hidden_shape[:-2]  # rows: (B, S)
    refusal, tables = _rope_refusal(cos, sin, rows, d, q.dtype), {}
    if refusal is None:  # a row per token ([1, S, d] tables broadcast over the batch: copied)
        tables = {"cos": cos.expand(*rows, d).reshape(-1, d), "sin": sin.expand(*rows, d).reshape(-1, d)}
    else:
        _count("fallback:rope:" + refusal)
    qn, kn = rosekernels.qk_norm(q.view(-1, q.shape[-1] // d, d), k.view(-1, k.shape[-1] // d, d), wq, wk,
                                 eps=attn.q_norm.variance_epsilon, **tables)
    qn, kn = qn.view(hidden_shape).transpose(1, 2), kn.view(hidden_shape).transpose(1, 2)
    return (qn, kn) if tables else attn._rope(qn, kn, cos, sin)


def _qk_norm_refusal(q: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> str | None:
    """Why rosekernels.qk_norm cannot norm these heads with these weights (None: it can)."""
    if not q.is_cuda:
        return "device"
    if q.dtype not in qk_norm_plan.DTYPES or wq.dtype not in (q.dtype, torch.float32) or wk.dtype != wq.dtype:
        return "dtype"
    return None


def _rope_refusal(cos: torch.Tensor, sin: torch.Tensor, rows: tuple, d: int, dtype: torch.dtype) -> str | None:
    """Why qk_norm cannot apply the rotary embedding of these tables to heads of `rows` tokens as the stock forward
    does (None: it can): a row of d values per token ([B or 1, S or 1, d] here), in q's dtype (in another, stock's
    rotation returns that of torch's type promotion: fp32 tables make fp32 heads)."""
    if cos.shape != sin.shape or cos.shape[-1] != d or cos.dim() != len(rows) + 1 or any(
            c not in (1, r) for c, r in zip(cos.shape[:-1], rows)):
        return "shape"
    if cos.dtype != dtype or sin.dtype != dtype:
        return "dtype"
    return None


def _gemm_refusal(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why rosekernels.gemm cannot compute x @ w^T + bias (None: it can)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or (
            bias is not None and bias.dtype not in (x.dtype, torch.float32)):
        return "dtype"
    if not gemm_leakyrelu_plan.takes(*w.shape):
        return "shape"
    if not x.is_cuda:
        return "device"
    return None


def _plain_linear(m: nn.Module) -> bool:
    """An nn.Linear whose forward is F.linear of its own floating-point weight: not a subclass (LoRA,
    quantized layers), no hooks."""
    return (type(m) is nn.Linear and m.weight.is_floating_point() and not m._forward_hooks
            and not m._forward_pre_hooks)


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w^T + bias (x [..., K] -> [..., N]) on rosekernels.gemm where it takes them, else F.linear (the
    reason counted)."""
    reason = _gemm_refusal(x, w, bias)
    if reason is not None:
        _count(f"fallback:gemm:{reason}")
        return F.linear(x, w, bias)
    _count("gemm")
    return rosekernels.gemm(x.reshape(-1, w.shape[1]), w, bias).view(*x.shape[:-1], w.shape[0])


def _linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """lin(x) on rosekernels.gemm where lin is a plain nn.Linear (_gemm)."""
    if not _plain_linear(lin):
        _count("fallback:gemm:module")
        return lin(x)
    return _gemm(x, lin.weight, lin.bias)


class Fp8Linear(nn.Module):
    """A linear layer (of nn.Linear's) whose weight is held in e4m3 with its scales (quantize_weight_fp8, once)
    and run on rosekernels.gemm_fp8: forward(x) quantizes x per token (per 1 x 128 group for the block scheme)
    first; forward(x, x_scale) takes an e4m3 x with its scales (a norm's fp8 output)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str, gated: bool = False):
        super().__init__()
        q, scale = rosekernels.quantize_weight_fp8(weight.detach(), scheme)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.scheme, self.gated, self.out_dtype = scheme, gated, weight.dtype
        self.group = fp8_math.BLOCK if scheme == "block" else None  # the activations' scale blocks

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None, activation: str | None = None):
        k = self.weight.shape[1]
        if x_scale is None:
            x, x_scale = rosekernels.quantize_fp8(x, self.group)
        _count("gemm_fp8")
        out = rosekernels.gemm_fp8(x.reshape(-1, k), x_scale.reshape(x.numel() // k, -1) if self.group
                                   else x_scale.reshape(-1), self.weight, self.weight_scale, self.bias,
                                   activation=activation, gated=self.gated, out_dtype=self.out_dtype)
        return out.view(*x.shape[:-1], out.shape[-1])


def _project(lin: nn.Module, x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    """lin(x): an Fp8Linear on e4m3 x with its scales (or x to quantize), else `_linear`."""
    return lin(x, x_scale) if isinstance(lin, Fp8Linear) else _linear(lin, x)


def _qkv(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v projections of x [..., K] in one GEMM over qkv_weight (see _patch_qkv): column slices
    [..., Hq*d], [..., Hk*d], [..., Hk*d] of its [..., Hq*d + 2*Hk*d] output."""
    return _gemm(x, attn.qkv_weight, attn.qkv_bias).split(attn.qkv_rows, dim=-1)


_QKV = ("q_proj", "k_proj", "v_proj")


def _qkv_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict() of an attention with qkv_weight as the stock one writes it: q_proj, k_proj and v_proj's
    weight (and bias) first, each its own host copy (not views of one tensor, which safetensors refuses to
    save; with keep_vars too: no Parameter holds them), then the module's other entries in their order."""
    if prefix + "qkv_weight" not in state_dict:
        return
    own = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}  # the last entries
    fused = {name: own.pop(prefix + f"qkv_{name}", None) for name in ("weight", "bias")}
    for i, proj in enumerate(_QKV):
        for name, w in fused.items():
            if w is not None:
                part = w.detach().split(module.qkv_rows)[i]
                state_dict[f"{prefix}{proj}.{name}"] = part if part.is_meta else part.to("cpu", copy=True)
    state_dict.update(own)


def _qkv_load_state_dict(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict() of a stock attention's q/k/v keys into one with qkv_weight: their rows concatenated."""
    for name in ("weight", "bias"):
        keys = [f"{prefix}{proj}.{name}" for proj in _QKV]
        if all(k in state_dict for k in keys):
            state_dict[prefix + f"qkv_{name}"] = torch.cat([state_dict.pop(k) for k in keys])


def _split_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up weights in a gated GEMM's weight (rosekernels.gate_up_rows undone)."""
    pairs = w.unflatten(0, (-1, 2, gemm_leakyrelu_plan.GATE_BLOCK))
    return pairs[:, 0].flatten(0, 1), pairs[:, 1].flatten(0, 1)


class _MLP:
    """The SwiGLU MLP on two GEMMs: silu(x @ gate^T) * (x @ up^T) in one gated GEMM over gate_up_weight
    (see _patch_mlp), then the down projection; in FP8 (_quantize_mlp) on gemm_fp8, x maybe already in e4m3
    with its scales (x_scale: the post-attention norm's fp8 output)."""

    def forward(self, x: torch.Tensor, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.down_proj, Fp8Linear):  # and gate_up_fp8 holds the interleaved gate/up rows
            _count("mlp_fp8")
            return self.down_proj(self.gate_up_fp8(x, x_scale, activation="silu"))
        w, down = self.gate_up_weight, self.down_proj.weight
        reason = _gemm_refusal(x, w) or _gemm_refusal(x, down)
        if reason is not None:
            _count(f"fallback:mlp:{reason}")
            gate, up = _split_gate_up(w)
            return self.down_proj(self.act_fn(F.linear(x, gate)) * F.linear(x, up))
        _count("mlp")
        h = rosekernels.gemm(x.reshape(-1, x.shape[-1]), w, activation="silu", gated=True)
        return rosekernels.gemm(h, down).view(*x.shape[:-1], down.shape[0])


def _mlp_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict() of a patched MLP as the stock one writes it: gate_proj.weight, up_proj.weight,
    down_proj.weight. The gate and up rows are not views of the interleaved weight: they are copies, in
    host memory (a whole model's worth on the GPU at once could run it out of memory). An FP8 MLP's
    e4m3 weights stay as they are."""
    if prefix + "gate_up_weight" not in state_dict:
        return
    gate, up = _split_gate_up(state_dict.pop(prefix + "gate_up_weight").detach().cpu())
    down = state_dict.pop(prefix + "down_proj.weight")
    state_dict.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                       prefix + "down_proj.weight": down})


def _mlp_load_state_dict(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict() of a stock MLP's keys into a patched one: gate and up interleaved."""
    gate, up = prefix + "gate_proj.weight", prefix + "up_proj.weight"
    if gate in state_dict and up in state_dict:
        state_dict[prefix + "gate_up_weight"] = rosekernels.gate_up_rows(state_dict.pop(gate), state_dict.pop(up))


class _Attention:
    """The stock Qwen3 attention forward (transformers 5.17) with q_norm, k_norm and the rotary embedding in one
    qk_norm launch and the projections on rosekernels.gemm."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple, attention_mask: torch.Tensor | None,
                past_key_values: Any = None, **kwargs: Any) -> tuple:
        x_scale = kwargs.pop("fp8_scales", None)  # FP8 projections: hidden_states in e4m3 with these scales
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        if hasattr(self, "qkv_weight"):
            q, k, v = _qkv(self, hidden_states)
        elif hasattr(self, "qkv_fp8"):  # an FP8 layer's q, k and v in one weight (Plan.fp8_qkv)
            q, k, v = self.qkv_fp8(hidden_states, x_scale).split(self.qkv_rows, dim=-1)
        else:  # per-tensor FP8 layers, and projections that are not plain nn.Linear modules
            q, k, v = (_project(getattr(self, p), hidden_states, x_scale) for p in _QKV)
        query_states, key_states = _normed_qk(self, q, k, hidden_shape, cos, sin)
        value_states = v.view(hidden_shape).transpose(1, 2)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return _project(self.o_proj, attn_output, None), attn_weights


class _DecoderLayer:
    """The stock decoder layer with the residual add after attention fused into post_attention_layernorm; in
    an FP8 layer the norms before FP8 projections or an FP8 MLP quantize their output in the same launch."""

    # The activations of the FP8 attention projections and MLP: "row", "group" (fp8 scale blocks) or None.
    fp8_attention = fp8_mlp = None
    fp8_scheme = None  # the fp8 of the apply() that patched the layer (None: bf16)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool | None = False,
                position_embeddings: tuple | None = None, **kwargs: Any) -> torch.Tensor:
        residual = hidden_states
        if self.fp8_attention is not None:
            hidden_states, kwargs["fp8_scales"] = self.input_layernorm(hidden_states, fp8=self.fp8_attention)
        else:
            hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                          position_ids=position_ids, past_key_values=past_key_values,
                                          use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        if self.fp8_mlp is not None:
            x, x_scale, residual = self.post_attention_layernorm(hidden_states, residual=residual, fp8=self.fp8_mlp)
            return residual + self.mlp(x, x_scale)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual=residual)
        return residual + self.mlp(hidden_states)


# Module-level classes (not made on the fly), so that a patched model pickles.
class RoseQwen3RMSNorm(_RMSNorm, q3.Qwen3RMSNorm):
    pass


class RoseQwen3MoeRMSNorm(_RMSNorm, q3m.Qwen3MoeRMSNorm):
    pass


class RoseQwen3Attention(_Attention, q3.Qwen3Attention):
    _rope = staticmethod(q3.apply_rotary_pos_emb)
    _eager = staticmethod(q3.eager_attention_forward)


class RoseQwen3MoeAttention(_Attention, q3m.Qwen3MoeAttention):
    _rope = staticmethod(q3m.apply_rotary_pos_emb)
    _eager = staticmethod(q3m.eager_attention_forward)


class RoseQwen3DecoderLayer(_DecoderLayer, q3.Qwen3DecoderLayer):
    pass


class RoseQwen3MLP(_MLP, q3.Qwen3MLP):
    pass


def _router_refusal(hidden_states: torch.Tensor) -> str | None:
    if not hidden_states.is_cuda:
        return "device"
    return None if hidden_states.dtype in (torch.bfloat16, torch.float16, torch.float32) else "dtype"


class _Router:
    """The router's softmax, top-k and renormalisation in one rosekernels.moe_route launch after its
    GEMM (torch's: 4-6 launches). The weights come in the logits' dtype as stock's do, the ids in int32
    (moe_dispatch's; experts_forward hands stock paths int64) while the model's experts run on rosekernels,
    int64 after a set_experts_implementation() of another."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reason = _router_refusal(hidden_states)
        if reason is not None:
            _count(f"fallback:router:{reason}")
            return super().forward(hidden_states)
        _count("router")
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, ids = rosekernels.moe_route(logits, self.top_k, self.norm_topk_prob, weight_dtype=logits.dtype)
        served = self._rosekernels_config._experts_implementation == IMPLEMENTATION
        return logits, weights, ids if served else ids.long()


class RoseQwen3MoeTopKRouter(_Router, q3m.Qwen3MoeTopKRouter):
    pass


class RoseQwen3MoeMLP(_MLP, q3m.Qwen3MoeMLP):
    pass


class RoseQwen3MoeDecoderLayer(_DecoderLayer, q3m.Qwen3MoeDecoderLayer):
    pass


_PATCHED = {cls.__bases__[1]: cls for cls in (RoseQwen3RMSNorm, RoseQwen3MoeRMSNorm, RoseQwen3Attention,
                                              RoseQwen3MoeAttention, RoseQwen3DecoderLayer, RoseQwen3MoeDecoderLayer,
                                              RoseQwen3MLP, RoseQwen3MoeMLP, RoseQwen3MoeTopKRouter)}
_RMSNORMS = (q3.Qwen3RMSNorm, q3m.Qwen3MoeRMSNorm)


# ---------------------------------------------------------------------------------------------
# The functions registered with transformers.


def _strides_ok(t: torch.Tensor) -> bool:
    """What the attention kernels' TMA needs of q/k/v besides alignment (fresh allocations, their slices along S,
    and the column slices of the fused q/k/v GEMM's output, which `fuses_qkv` starts on 16-byte columns, are
    16-byte aligned): a unit last stride and 16-byte strides where a dim is > 1."""
    vec = 16 // t.element_size()
    if t.stride(-1) != 1:
        return False
    for n, s in zip(t.shape[:-1], t.stride()[:-1]):  # a loop, not a generator: torch.compile traces it
        if n > 1 and s % vec:
            return False
    return True


def _attention_refusal(query, key, value, attention_mask, dropout, kwargs, kv_dtype=None) -> str | None:
    """Why rosekernels.attention cannot serve this call (None: it can); kv_dtype: the keys' and values' dtype
    when not the query's (an Fp8StaticCache's e4m3)."""
    if attention_mask is not None:
        return "mask"
    if dropout:
        return "dropout"
    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        return "bias"
    if query.dtype not in (torch.bfloat16, torch.float16) or {key.dtype, value.dtype} != {kv_dtype or query.dtype}:
        return "dtype"
    if query.shape[-1] not in attention_plan.HEAD_DIMS or value.shape[-1] != query.shape[-1]:
        return "head_dim"
    if not query.is_cuda:
        return "device"
    if not (_strides_ok(query) and _strides_ok(key) and _strides_ok(value)):
        return "strides"
    return None


def prefix_mask(**kwargs: Any) -> torch.Tensor | None:
    """sdpa's mask (transformers' mask-function contract), marked when it is a causal mask over a
    prefix of the keys per sequence (no padding, no other pattern), with each sequence's key count
    computed on the device from its last row: a static cache hands attention its whole length,
    the keys past the current one masked, and such a mask lets the decode kernel serve that call
    with the counts (attention_with_kvcache) instead of falling back. Whether there is padding is
    known on the host when no 2D mask is given; a given one (generate() always gives one) is read:
    one sync per forward, which sdpa's own mask function skips for a static cache. While a graph is
    captured that read cannot happen, and such a call falls back. A mask built inside a compiled
    region is not marked (traced code would keep the mark as a constant); one built before it,
    as generate() builds them, keeps its mark there."""
    mask = sdpa_mask(**kwargs)
    if mask is None or mask.dtype != torch.bool or torch.compiler.is_compiling():
        return mask
    padding = kwargs.get("attention_mask")
    if (kwargs.get("mask_function") is not causal_mask_function or kwargs.get("local_size") is not None
            or kwargs.get("kv_offset", 0) != 0):
        return mask
    if padding is not None:
        if padding.is_cuda and torch.cuda.is_current_stream_capturing():
            return mask
        # Every key up to the last query's is valid: all ones, and long enough (sdpa pads a short
        # 2D mask with False, which would hide keys the causal rows see).
        seen = kwargs.get("q_offset", 0) + kwargs["q_length"]
        if not bool(padding.all() & (padding.shape[-1] >= torch.as_tensor(seen, device=padding.device))):
            return mask
    mask._rosekernels_key_counts = mask[:, 0, -1].sum(-1, dtype=torch.int32)  # [B]: sdpa_mask expands to the batch
    return mask


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, Hq, S_q, d], key/value [B, Hkv, S_kv, d];
    returns ([B, S_q, Hq, d], None). Without a mask tensor the call means what it means to sdpa, and
    is computed the same way: causal (top-left) when S_q > 1, over the first S_q keys when a static
    cache hands more (its prefill), and over all keys when S_q == 1. With a mask that `prefix_mask`
    marked (a static cache's decode step: S_q <= 16 tokens after each sequence's earlier keys), the
    KV-cache decode kernel reads each sequence's key count from the device: no sync, capturable. An
    Fp8StaticCache's e4m3 keys and values go to that kernel with their descales on such a step, and are
    dequantized for any other call."""
    counts = getattr(attention_mask, "_rosekernels_key_counts", None)
    descales = getattr(key, "_rosekernels_descales", None)  # (k_descale, v_descale) of an Fp8StaticCache
    marked = counts is not None and query.shape[2] <= attention_decode_plan.MAX_SEQLEN_Q
    if marked:
        reason = _attention_refusal(query, key, value, None, dropout, kwargs, key.dtype if descales else None)
        if reason is None:
            _count("attention_decode" if descales is None else "attention_decode_fp8")
            scales = {} if descales is None else {"k_descale": descales[0], "v_descale": descales[1]}
            out = rosekernels.attention_with_kvcache(query.transpose(1, 2), key.transpose(1, 2),
                                                     value.transpose(1, 2), counts, softmax_scale=scaling, **scales)
            return out, None
    if descales is not None:  # any other call reads the e4m3 cache dequantized, in fp32 as the decode kernel
        key, value = ((t.float() * d).to(query.dtype) for t, d in zip((key, value), descales))
    if not marked:
        reason = _attention_refusal(query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        _count(f"fallback:attention:{reason}")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_len = query.shape[2]
    causal = q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    _count("attention_decode" if q_len <= attention_decode_plan.MAX_SEQLEN_Q else "attention_prefill")
    out = rosekernels.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                                softmax_scale=scaling)
    return out, None


class Fp8StaticLayer(StaticLayer):
    """A StaticLayer holding its keys and values in e4m3 (see Fp8StaticCache)."""

    def __init__(self, max_cache_len: int, k_descale: float, v_descale: float):
        super().__init__(max_cache_len)
        self.descale_values = (float(k_descale), float(v_descale))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = fp8_math.E4M3, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        rows = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros(*rows, key_states.shape[-1], dtype=self.dtype, device=self.device)
        self.values = torch.zeros(*rows, value_states.shape[-1], dtype=self.dtype, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.descales = tuple(torch.full((1,), d, device=self.device) for d in self.descale_values)
        if not torch.compiler.is_compiling():  # fixed addresses, as StaticLayer's: CUDA graphs
            for t in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.cumulative_length.to(torch.int32).expand(self.batch_size)  # each sequence's next row
        rosekernels.append_kvcache(self.keys.transpose(1, 2), self.values.transpose(1, 2), key_states.transpose(1, 2),
                                   value_states.transpose(1, 2), start, None, *self.descales)
        self.cumulative_length.add_(key_states.shape[-2])
        # What attention_forward reads them with, set on each call: reorder_cache, offload and prefetch
        # replace the keys tensor, and with it its attributes.
        self.keys._rosekernels_descales = self.descales
        return self.keys, self.values


class Fp8StaticCache(StaticCache):
    """transformers' StaticCache with the keys and values in e4m3: half the bytes a decode step's attention
    reads. The cache holds e4m3(k / k_descale) and e4m3(v / v_descale) (one value each, saturating at 448):
    1.0 suits normalized keys (Qwen3's q/k norms) and values of order one; calibrate them otherwise. New keys
    and values are quantized on the way in (rosekernels.append_kvcache); on a patched model (apply) a decode
    step attends to the e4m3 cache (attention_with_kvcache), other calls to it dequantized. For models whose
    every layer is full attention; rosekernels.hf.warmup(model, fp8_kv_cache=True) compiles its kernels."""

    def __init__(self, config: Any, max_cache_len: int, k_descale: float = 1.0, v_descale: float = 1.0,
                 **kwargs: Any):
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        if any(type(layer) is not StaticLayer for layer in self.layers):
            raise ValueError("Fp8StaticCache holds full-attention layers only; this config has other kinds")
        self.layers = [Fp8StaticLayer(max_cache_len, k_descale, v_descale) for _ in self.layers]


_grouped_mm = getattr(torch, "_grouped_mm", None)


def _experts_refusal(experts: nn.Module, hidden_states: torch.Tensor, path: str = "grouped_mm") -> str | None:
    """Why the rosekernels MoE path `path` cannot serve this call (None: it can)."""
    if experts.has_bias or experts.is_transposed or not experts.has_gate or not experts.is_concatenated:
        return "layout"
    dtypes = {hidden_states.dtype, experts.gate_up_proj.dtype, experts.down_proj.dtype}
    if path == "moe_experts":
        if len(dtypes) > 1 or not dtypes <= {torch.bfloat16, torch.float16}:
            return "dtype"
        if not isinstance(experts.act_fn, (nn.SiLU, SiLUActivation)):  # its gated epilogue is SwiGLU's
            return "activation"
        if experts.num_experts > grouped_gemm_plan.MAX_EXPERTS or not grouped_gemm_plan.model_gemms(
                ModelDims("experts", experts.hidden_dim, 0, 1, 1, 1, experts.num_experts, 1, experts.intermediate_dim)):
            return "shape"
    else:
        if _grouped_mm is None:
            return "no_grouped_mm"
        # torch._grouped_mm's sm_90 kernel is bf16 only; other dtypes take a loop that synchronises the host.
        if dtypes != {torch.bfloat16}:
            return "dtype"
    if not hidden_states.is_cuda:
        return "device"
    return None


def _stock_experts(experts: nn.Module) -> Callable:
    """The experts implementation the model had before apply() ("eager": the undecorated forward)."""
    return ALL_EXPERTS_FUNCTIONS.get_interface(getattr(experts, "_rosekernels_fallback", "grouped_mm"),
                                               type(experts).forward.__wrapped__)


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts contract: hidden_states [T, H], top_k_index/top_k_weights [T, k] -> [T, H]."""
    path = getattr(experts, "_rosekernels_path", EXPERTS_PATH)
    reason = _experts_refusal(experts, hidden_states, path)
    if reason is not None:
        _count(f"fallback:experts:{reason}")
        # (the ids of a patched router are int32; stock paths index with int64, one_hot among them)
        return _stock_experts(experts)(experts, hidden_states, top_k_index.long(), top_k_weights)
    _count("experts")
    if path == "moe_experts":  # the weights as stored: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj
        return rosekernels.moe_experts(hidden_states, experts.gate_up_proj, experts.down_proj,
                                       top_k_index.to(torch.int32), top_k_weights)
    d = rosekernels.moe_dispatch(hidden_states, top_k_index.to(torch.int32), experts.num_experts, block_size=1)
    ends = d.offsets[1:]  # expert e's rows end at offsets[e + 1]: grouped_mm's group ends
    gate_up = _grouped_mm(d.buffer, experts.gate_up_proj.transpose(-2, -1), offs=ends)
    down = _grouped_mm(experts._apply_gate(gate_up), experts.down_proj.transpose(-2, -1), offs=ends)
    return rosekernels.moe_combine(down, top_k_weights, d.slot_map)


AttentionInterface.register(IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, prefix_mask)  # sdpa's: None where sdpa would rely on is_causal
ExpertsInterface.register(IMPLEMENTATION, experts_forward)


# ---------------------------------------------------------------------------------------------
# Planning (no GPU needed) and applying.


def _serves_rmsnorm(m: nn.Module) -> bool:
    return (type(m) in _RMSNORMS and m.weight.dim() == 1
            and 0 < m.weight.shape[0] <= rmsnorm_plan.MAX_HIDDEN and m.weight.shape[0] % 8 == 0)


def _is_rmsnorm(m: nn.Module) -> bool:
    return _serves_rmsnorm(m) or isinstance(m, _RMSNorm)


def _serves_attention(m: nn.Module) -> bool:
    return (type(m) in (q3.Qwen3Attention, q3m.Qwen3MoeAttention) and m.head_dim in qk_norm_plan.HEAD_DIMS
            and _is_rmsnorm(m.q_norm) and _is_rmsnorm(m.k_norm)
            and m.q_norm.variance_epsilon == m.k_norm.variance_epsilon)  # one launch, one eps


def _serves_qkv(m: nn.Module) -> bool:
    """An attention apply() serves whose q, k and v projections are plain linear layers of one input size, weight
    dtype and requires_grad, biases all or none (of one dtype), k and v alike, that gemm_leakyrelu_plan.fuses_qkv
    runs as one GEMM."""
    if not _serves_attention(m):
        return False
    projections = [getattr(m, p) for p in _QKV]
    if not all(map(_plain_linear, projections)) or len({p.weight.shape[1] for p in projections}) != 1:
        return False
    if len({(p.weight.dtype, p.weight.requires_grad, None if p.bias is None else p.bias.dtype)
            for p in projections}) != 1:
        return False
    q, k, v = (p.weight.shape[0] for p in projections)
    return k == v and gemm_leakyrelu_plan.fuses_qkv(q, k, projections[0].weight.shape[1])


def _fold_qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of q_proj, k_proj and v_proj, their rows concatenated; the three modules are removed (the
    weights are held once) and attn.qkv_rows keeps their sizes, by which the one GEMM's output splits."""
    projections = [getattr(attn, p) for p in _QKV]
    with torch.no_grad():
        w = torch.cat([p.weight for p in projections])
        bias = None if projections[0].bias is None else torch.cat([p.bias for p in projections])
    attn.qkv_rows = tuple(p.out_features for p in projections)
    for p in _QKV:
        delattr(attn, p)
    return w, bias


def _patch_qkv(m: nn.Module) -> None:
    """q_proj, k_proj and v_proj -> qkv_weight (and qkv_bias), _fold_qkv's; hooks keep state_dict's keys the stock
    ones."""
    grad = m.q_proj.weight.requires_grad
    w, bias = _fold_qkv(m)
    m.qkv_weight = nn.Parameter(w, requires_grad=grad)
    m.qkv_bias = None if bias is None else nn.Parameter(bias, requires_grad=grad)
    m.register_state_dict_post_hook(_qkv_state_dict)
    m.register_load_state_dict_pre_hook(_qkv_load_state_dict)


def _serves_layer(m: nn.Module) -> bool:
    # The fused forward calls post_attention_layernorm(x, residual=...): only a patched norm takes that.
    return type(m) in (q3.Qwen3DecoderLayer, q3m.Qwen3MoeDecoderLayer) and _is_rmsnorm(m.post_attention_layernorm)


def _serves_mlp(m: nn.Module) -> bool:
    projections = (m.gate_proj, m.up_proj, m.down_proj) if type(m) in (q3.Qwen3MLP, q3m.Qwen3MoeMLP) else ()
    return (bool(projections) and m.config.hidden_act == "silu"
            and all(_plain_linear(p) and p.bias is None for p in projections)
            and gemm_leakyrelu_plan.takes(2 * m.intermediate_size, m.hidden_size, gated=True)
            and gemm_leakyrelu_plan.takes(m.hidden_size, m.intermediate_size))


def _patch_mlp(m: nn.Module) -> None:
    """gate_proj and up_proj -> gate_up_weight, their rows interleaved for the gated GEMM (the Linear
    modules are removed: the weights are held once); hooks keep state_dict's keys the stock ones."""
    with torch.no_grad():
        w = rosekernels.gate_up_rows(m.gate_proj.weight, m.up_proj.weight)
    m.gate_up_weight = nn.Parameter(w, requires_grad=m.gate_proj.weight.requires_grad)
    del m.gate_proj, m.up_proj
    m.register_state_dict_post_hook(_mlp_state_dict)
    m.register_load_state_dict_pre_hook(_mlp_load_state_dict)
    _swap_class(m)


def _serves_experts(m: nn.Module) -> bool:
    if type(m) is not q3m.Qwen3MoeExperts:
        return False
    # The model's current implementation is the fallback: one of the registry's (or "eager"), not
    # already ours, and not a quantized one (those live in another registry).
    current = m.config._experts_implementation
    return (current != IMPLEMENTATION and (current == "eager" or current in ALL_EXPERTS_FUNCTIONS)
            and m.has_gate and not m.has_bias and not m.is_transposed and m.is_concatenated
            and m.num_experts <= moe_dispatch_plan.THREADS and m.hidden_dim % 8 == 0)


def _serves_router(m: nn.Module) -> bool:
    """An MoE block whose experts apply() serves (so that the int32 ids of moe_route go to experts_forward) and
    whose router moe_route takes."""
    gate = getattr(m, "gate", None)
    return (type(m) is q3m.Qwen3MoeSparseMoeBlock and _serves_experts(m.experts)
            and type(gate) is q3m.Qwen3MoeTopKRouter and moe_route_plan.takes(gate.num_experts, gate.top_k))


def _patch_router(m: nn.Module) -> None:
    m.gate._rosekernels_config = m.experts.config  # (a config, not a module: no submodule, no state_dict entry)
    _swap_class(m.gate)


def _swap_class(m: nn.Module) -> None:
    m.__class__ = _PATCHED[type(m)]


def _route_experts(m: nn.Module) -> None:
    """Remember the model's experts implementation for fallbacks (_swap then switches the model)."""
    m._rosekernels_fallback = m.config._experts_implementation


@dataclasses.dataclass(frozen=True)
class Swap:
    kind: str
    what: str  # one line: what replaces what
    matches: Callable[[nn.Module], bool]
    patch: Callable[[nn.Module], None]


# In order (a decoder layer's fused forward needs its norms patched).
SWAPS = (
    Swap("rmsnorm", "RMSNorm -> rosekernels.rmsnorm", _serves_rmsnorm, _swap_class),
    Swap("attention", "q_norm + k_norm + rotary embedding -> one rosekernels.qk_norm; "
         "attention -> rosekernels.attention; "
         "o projection -> rosekernels.gemm", _serves_attention, _swap_class),
    Swap("qkv", "q, k and v projections -> one rosekernels.gemm (their weights' rows concatenated)", _serves_qkv,
         _patch_qkv),
    Swap("decoder_layer", "residual add after attention -> fused into post_attention_layernorm's rmsnorm",
         _serves_layer, _swap_class),
    Swap("mlp", "dense MLP -> rosekernels.gemm gated (SwiGLU) + rosekernels.gemm (down projection)", _serves_mlp,
         _patch_mlp),
    Swap("experts", "MoE experts (EXPERTS_WHAT)", _serves_experts, _route_experts),
    Swap("router", "MoE router's softmax, top-k and renormalisation -> rosekernels.moe_route", _serves_router,
         _patch_router),
)
LEFT_ON_TORCH = ("the rotary tables (once a forward)", "embedding, the MoE router's GEMM and lm_head")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What apply() replaces: for each kind of SWAPS, the names of the modules (as model.named_modules()),
    the path the experts take (a key of EXPERTS_WHAT), and with an FP8 scheme (fp8) the decoder layers whose
    attention projections (fp8_attention) and MLP (fp8_mlp) run on gemm_fp8, and those of fp8_attention whose q,
    k and v run as one (fp8_qkv)."""

    model_type: str
    swaps: dict[str, tuple[str, ...]]
    experts: str = EXPERTS_PATH
    fp8: str | None = None
    fp8_attention: tuple[str, ...] = ()
    fp8_mlp: tuple[str, ...] = ()
    fp8_qkv: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"rosekernels.hf plan for a {self.model_type} model:"]
        lines += [f"  {len(self.swaps[s.kind]):4d} x {EXPERTS_WHAT[self.experts] if s.kind == 'experts' else s.what}"
                  for s in SWAPS]
        if self.fp8 is not None:
            lines += [f"  {len(self.fp8_attention):4d} x q/k/v/o projections -> e4m3 weights ({self.fp8}), "
                      "rosekernels.gemm_fp8, activations quantized in the input norm and by quantize_fp8; "
                      f"q, k and v as one weight in {len(self.fp8_qkv)}",
                      f"  {len(self.fp8_mlp):4d} x dense MLP -> e4m3 weights ({self.fp8}), gated and down "
                      "rosekernels.gemm_fp8, activations quantized in the post-attention norm and by quantize_fp8"]
        lines += [f"  left on torch: {what}" for what in LEFT_ON_TORCH]
        return "\n".join(lines)


def _experts_path(model: nn.Module, experts: str | None) -> str:
    """The path of `model`'s MoE experts: the one apply() installed (None asks for it; another is
    refused: apply() does not move experts already served), else `experts` (None: EXPERTS_PATH)."""
    installed = {m._rosekernels_path for m in model.modules() if hasattr(m, "_rosekernels_path")}
    if experts is not None and experts not in EXPERTS_WHAT:
        raise ValueError(f"experts must be one of {sorted(EXPERTS_WHAT)}, got {experts!r}")
    if not installed:
        return EXPERTS_PATH if experts is None else experts
    (path,) = installed  # apply() installs one path
    if experts not in (None, path):
        raise ValueError(f"the model's MoE experts already run on {path!r}; apply() does not move them to "
                         f"{experts!r} (load the model anew for another path)")
    return path


def _fp8_scheme(model: nn.Module, fp8: str | None) -> str | None:
    """The FP8 scheme of `model`'s linear layers: the one apply() patched its decoder layers with, None for bf16
    (None asks for it; another is refused: apply() does not quantize layers it patched, in bf16 or with another
    scheme), else `fp8`."""
    if fp8 is not None and fp8 not in fp8_math.WEIGHT_SCHEMES:
        raise ValueError(f"fp8 must be None or one of {sorted(fp8_math.WEIGHT_SCHEMES)}, got {fp8!r}")
    installed = {m.fp8_scheme for m in model.modules() if isinstance(m, _DecoderLayer)}
    if not installed:
        return fp8
    (scheme,) = installed  # apply() patches every layer with one scheme
    if fp8 not in (None, scheme):
        now = "in bf16" if scheme is None else f"in FP8 ({scheme!r})"
        raise ValueError(f"the model's linear layers already run {now}; apply() does not quantize them with "
                         f"fp8={fp8!r} (load the model anew for another scheme)")
    return scheme


def _fp8_takes(sizes: list[tuple[int, int, bool]], dtype: torch.dtype, scheme: str) -> bool:
    """Whether gemm_fp8 takes every [N, K] weight of `sizes` ((N, K, gated)) of `dtype` with `scheme`'s
    scales, and quantize_fp8 (and the norms) their activations."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    scales, group = gemm_fp8_plan.scales_of(scheme), fp8_math.BLOCK if scheme == "block" else 0
    for n, k, gated in sizes:
        try:
            gemm_fp8_plan.check_sizes(n, k, gated, scales)
            quantize_fp8_plan.check_hidden(k, "bf16", group)
        except ValueError:
            return False
    return True


def _fp8_exclude(model: nn.Module, fp8: str | None, fp8_exclude: str | Iterable[str]) -> tuple[str, ...]:
    """fp8_exclude as a tuple of module names of `model`. ValueError for any name without an FP8 scheme, a name
    the model does not have, one that selects no decoder layer's attention or MLP (_excluded), or one that
    selects a block an earlier apply() already runs in FP8."""
    names = (fp8_exclude,) if isinstance(fp8_exclude, str) else tuple(fp8_exclude)
    if names and fp8 is None:
        raise ValueError("fp8_exclude names modules to keep in bf16 in a model run in FP8: give fp8= too")
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules and not _fused_away(n, modules)]
    if unknown:
        raise ValueError(f"fp8_exclude: the model has no module named {', '.join(map(repr, unknown))} (names as "
                         "model.named_modules() gives them, e.g. 'model.layers.0' or 'model.layers.0.mlp')")
    layers = {n: m for n, m in modules.items() if isinstance(m, (q3.Qwen3DecoderLayer, q3m.Qwen3MoeDecoderLayer))}
    blocks = {f"{n}.{b}": getattr(m, f"fp8_{'attention' if b == 'self_attn' else b}", None)
              for n, m in layers.items() for b in ("self_attn", "mlp")}  # block -> its FP8 activations, if any
    idle = [n for n in names if not any(_excluded(b, (n,)) for b in blocks)]
    if idle:
        raise ValueError(f"fp8_exclude: {', '.join(map(repr, idle))} selects no decoder layer's attention or MLP, "
                         "the only blocks that run in FP8 (lm_head, the embeddings and the norms keep the model's "
                         "dtype)")
    done = [b for b, fp8_in in blocks.items() if fp8_in is not None and _excluded(b, names)]
    if done:
        raise ValueError(f"fp8_exclude: {', '.join(done)} already run(s) in FP8 (an earlier apply()); apply() does "
                         "not return them to bf16 (load the model anew)")
    return names


def _fused_away(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether `name` is a projection an earlier apply() folded into its parent's one weight (an attention's
    q/k/v_proj into qkv_weight or qkv_fp8, an MLP's gate/up_proj into gate_up_weight or gate_up_fp8): fp8_exclude
    names it as before."""
    parent, _, leaf = name.rpartition(".")
    m = modules.get(parent)
    if m is None:
        return False
    if leaf in _QKV:
        return hasattr(m, "qkv_rows")
    return leaf in ("gate_proj", "up_proj") and (hasattr(m, "gate_up_weight") or hasattr(m, "gate_up_fp8"))


def _excluded(block: str, exclude: tuple[str, ...]) -> bool:
    """Whether `block` (a layer's self_attn or mlp) stays in bf16: a name in `exclude` is the block, a module
    above it, or one inside it (its linear layers share their quantized activations: all or none run in FP8)."""
    return any(block == e or block.startswith(e + ".") or e.startswith(block + ".") for e in exclude)


def _fp8_layers(model: nn.Module, swaps: dict[str, tuple[str, ...]], scheme: str,
                exclude: tuple[str, ...]) -> tuple[tuple, tuple]:
    """(layers whose attention projections run in FP8, layers whose MLP does): decoder layers apply() patches
    whose attention (plain projections) and dense MLP it patches too, where the FP8 kernels take the sizes and
    `exclude` (_excluded) keeps none of them in bf16."""
    modules = dict(model.named_modules())
    attention, mlp = [], []
    for name in swaps["decoder_layer"]:
        attn, ffn = modules[name].self_attn, modules[name].mlp
        projections = [getattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if f"{name}.self_attn" in swaps["attention"] and not _excluded(f"{name}.self_attn", exclude) and all(
                map(_plain_linear, projections)) and _fp8_takes(
                [(*p.weight.shape, False) for p in projections], projections[0].weight.dtype, scheme):
            attention.append(name)
        if f"{name}.mlp" in swaps["mlp"] and not _excluded(f"{name}.mlp", exclude):
            (inter, hidden), down = ffn.gate_proj.weight.shape, ffn.down_proj.weight
            if _fp8_takes([(2 * inter, hidden, True), (*down.shape, False)], down.dtype, scheme):
                mlp.append(name)
    return tuple(attention), tuple(mlp)


def plan(model: nn.Module, experts: str | None = None, fp8: str | None = None,
         fp8_exclude: str | Iterable[str] = ()) -> Plan:
    """The modules apply() would replace in `model` (any device, meta included), its experts on path
    `experts` (None: the path apply() installed, else EXPERTS_PATH), with `fp8` (a scheme of
    rosekernels.fp8.WEIGHT_SCHEMES, or None: bf16, or the scheme apply() installed) the layers whose linear
    layers run on gemm_fp8, but for the blocks `fp8_exclude` keeps in bf16; modules already replaced are not
    listed again. Raises ValueError for a model that is not Qwen3 / Qwen3-MoE, an unknown path or scheme, a
    path other than the one its experts already run on, a scheme other than the one (or bf16) its linear
    layers already run in, or an fp8_exclude name the model does not have (or without a scheme)."""
    experts = _experts_path(model, experts)
    fp8 = _fp8_scheme(model, fp8)
    if not transformers.__version__.startswith(TRANSFORMERS):
        raise ValueError(f"rosekernels.hf follows transformers {TRANSFORMERS}x's Qwen3 code; this is transformers "
                         f"{transformers.__version__} (pip install 'rosekernels[hf]')")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"rosekernels.hf serves Qwen3 and Qwen3-MoE models (model_type {' or '.join(MODEL_TYPES)}); "
                         f"got {model_type!r}")
    exclude = _fp8_exclude(model, fp8, fp8_exclude)  # (after the model's type: its names are a Qwen3's)
    modules = list(model.named_modules())
    swaps = {s.kind: tuple(n for n, m in modules if s.matches(m)) for s in SWAPS}
    fp8_attention, fp8_mlp = _fp8_layers(model, swaps, fp8, exclude) if fp8 is not None else ((), ())
    # FP8 layers fold q, k and v into one e4m3 weight where its scales are those of the three apart (fp8_qkv)
    by_name = dict(modules)

    def fp8_fuses(attn: nn.Module) -> bool:
        return gemm_fp8_plan.fuses_qkv(attn.q_proj.out_features, attn.k_proj.out_features, attn.q_proj.in_features,
                                       fp8)

    fp8_qkv = tuple(n for n in fp8_attention if f"{n}.self_attn" in swaps["qkv"] and fp8_fuses(by_name[n].self_attn))
    swaps["qkv"] = tuple(n for n in swaps["qkv"] if n.rpartition(".")[0] not in fp8_attention)
    return Plan(model_type, swaps, experts, fp8, fp8_attention, fp8_mlp, fp8_qkv)


def _require_gpu(model: nn.Module) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("rosekernels.hf.apply needs an sm_90 GPU (H100/H200): no CUDA device is visible")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise RuntimeError(f"rosekernels.hf.apply needs the model on one GPU; its parameters are on "
                           f"{sorted(map(str, devices))} (move it first: model.to('cuda'))")
    cc = torch.cuda.get_device_capability(next(iter(devices)))
    if cc != (9, 0):
        raise RuntimeError(f"rosekernels.hf.apply needs an sm_90 GPU (H100/H200); the model's is sm_{cc[0]}{cc[1]}")


def _swap(model: nn.Module, p: Plan) -> None:
    """Carry out plan `p` on `model` (no device checks: apply() made them)."""
    modules = dict(model.named_modules())
    for swap in SWAPS:
        for name in p.swaps[swap.kind]:
            swap.patch(modules[name])
    for name in p.swaps["experts"]:
        modules[name]._rosekernels_path = p.experts
    for name in p.swaps["decoder_layer"]:
        modules[name].fp8_scheme = p.fp8
    activations = "group" if p.fp8 == "block" else "row"
    for name in p.fp8_attention:  # each weight quantized once, the bf16 one dropped
        layer, attn = modules[name], modules[name].self_attn
        apart = _QKV + ("o_proj",)
        if name in p.fp8_qkv:
            attn.qkv_fp8 = Fp8Linear(*_fold_qkv(attn), p.fp8)
            apart = ("o_proj",)
        for proj in apart:
            lin = getattr(attn, proj)
            setattr(attn, proj, Fp8Linear(lin.weight, lin.bias, p.fp8))
        layer.fp8_attention = activations
    for name in p.fp8_mlp:
        layer, mlp = modules[name], modules[name].mlp
        mlp.gate_up_fp8 = Fp8Linear(mlp.gate_up_weight, None, p.fp8, gated=True)
        del mlp.gate_up_weight
        mlp.down_proj = Fp8Linear(mlp.down_proj.weight, mlp.down_proj.bias, p.fp8)
        layer.fp8_mlp = activations
    model.set_attn_implementation(IMPLEMENTATION)
    if p.swaps["experts"]:
        model.set_experts_implementation(IMPLEMENTATION)


def apply(model: nn.Module, experts: str | None = None, fp8: str | None = None,
          fp8_exclude: str | Iterable[str] = ()) -> nn.Module:
    """Run `model` (a transformers Qwen3 or Qwen3-MoE model on an sm_90 GPU) on rosekernels: see the
    module docstring; `experts`: the MoE experts' path, "grouped_mm" or "moe_experts" (None:
    EXPERTS_PATH, or the path an earlier apply() installed; another than that one is refused); `fp8`: None
    (bf16 linear layers, or the scheme an earlier apply() installed) or the weight scheme of FP8 ones, "tensor",
    "channel" or "block" (rosekernels.quantize_weight_fp8), the weights quantized once here; on a model an
    earlier apply() patched, a scheme other than its own (bf16 included) is refused with ValueError: load the
    model anew to run it in FP8 or with another scheme. `fp8_exclude`: names of modules (model.named_modules())
    whose linear layers stay in bf16 in an FP8 model, as transformers' modules_to_not_convert: a decoder layer
    ("model.layers.0"), its attention or MLP, or a projection in them, which keeps its whole block (the block's
    projections share their quantized activations). Patches in place and returns the model; applying twice
    changes nothing more."""
    _require_gpu(model)
    p = plan(model, experts, fp8, fp8_exclude)
    # Load the ops now (rosekernels imports them on first use), so that the patched forwards find
    # plain module attributes, which torch.compile traces without a module __getattr__.
    for op in ("rmsnorm", "qk_norm", "attention", "gemm", "gate_up_rows", "moe_dispatch", "moe_combine",
               "moe_route", "moe_experts", "gemm_fp8", "quantize_fp8", "quantize_weight_fp8", "append_kvcache",
               "attention_with_kvcache"):
        getattr(rosekernels, op)
    _swap(model, p)
    return model


def warmup_specs(model: nn.Module, experts: str | None = None, fp8: str | None = None,
                 fp8_kv_cache: bool = False) -> list:
    """The kernel configs the patched model launches (its dims, dtype and norm eps, both modes; the MoE
    experts on path `experts`, None: the path apply() installed, else EXPERTS_PATH; its linear layers in FP8
    with weight scheme `fp8`, None: the scheme apply() installed, else bf16; with an Fp8StaticCache,
    fp8_kv_cache), for rosekernels.warmup: compiled or loaded up front instead of on the first calls. A path
    or scheme other than the one apply() installed is refused with ValueError, as apply() refuses it."""
    fp8 = _fp8_scheme(model, fp8)
    config = model.config
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[next(model.parameters()).dtype]
    dims = dataclasses.replace(ModelDims.from_config(config), dtype=dtype, fp8=fp8 or "none", fp8_kv=fp8_kv_cache)
    plans = [rmsnorm_plan, qk_norm_plan, attention_plan, attention_decode_plan, gemm_leakyrelu_plan, moe_dispatch_plan,
             moe_combine_plan, gemm_fp8_plan, quantize_fp8_plan]
    if _experts_path(model, experts) == "moe_experts":
        plans.append(grouped_gemm_plan)
    configs = [c for m in plans for c in m.variants_for([dims])]
    if any(isinstance(m, _Router) or _serves_router(m) for m in model.modules()):  # served, or to be
        configs += moe_route_plan.variants_for([dims])  # (dims.norm_topk is the config's norm_topk_prob)
    configs += attention_decode_plan.kvcache_variants_for([dims])  # a static cache's decode steps
    if fp8_kv_cache:  # an Fp8StaticCache's appends
        configs += [c for c in append_kvcache_plan.variants_for([dims]) if c.fp8]
    # Norm and router weights are in the model's dtype; the norms are specialised on eps.
    configs = [c for c in configs if getattr(c, "weight_dtype", dtype) == dtype]
    return [dataclasses.replace(c, eps=float(config.rms_norm_eps)) if hasattr(c, "eps") else c for c in configs]


def warmup(model: nn.Module, experts: str | None = None, fp8: str | None = None, fp8_kv_cache: bool = False,
           **kwargs: Any) -> Any:
    """rosekernels.warmup(warmup_specs(model, experts, fp8, fp8_kv_cache), **kwargs): exactly the kernels the
    patched model launches (rosekernels.warmup(model=config) compiles the same and the grouped GEMMs, with the
    norms at the default eps)."""
    return rosekernels.warmup(warmup_specs(model, experts, fp8, fp8_kv_cache), **kwargs)


# ---------------------------------------------------------------------------------------------
# Models with random weights (no download): the geometry of the released checkpoints, fewer layers.

_COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6}, hidden_act="silu")
GEOMETRIES = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def model_config(name: str, layers: int) -> Any:
    """The transformers config of `name` (a key of GEOMETRIES) with `layers` decoder layers."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; choose one of {sorted(GEOMETRIES)}")
    g = GEOMETRIES[name]
    dims = dict(hidden_size=g.hidden, intermediate_size=g.intermediate, num_hidden_layers=layers,
                num_attention_heads=g.heads_q, num_key_value_heads=g.heads_kv, head_dim=g.head_dim, **_COMMON)
    if not g.experts:
        return Qwen3Config(**dims)
    return Qwen3MoeConfig(num_experts=g.experts, num_experts_per_tok=g.topk, moe_intermediate_size=g.moe_intermediate,
                          norm_topk_prob=True, decoder_sparse_step=1, **dims)


def random_model(geometry: str | Any, layers: int | None = None, seed: int = 0, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """A model with random weights, built on `device` in eval mode: of `geometry` (a key of GEOMETRIES,
    with `layers` layers) or of a transformers config. transformers' initialisation (normal, std 0.02),
    then norm weights drawn around 1 (std 0.2: a kernel that ignored its weight would pass with the
    default ones)."""
    config = model_config(geometry, layers) if isinstance(geometry, str) else geometry
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _RMSNORMS):
                m.weight.normal_(1.0, 0.2)
    return model.eval()
