"""The dimensions of a transformer that decide which kernels it needs, from a Hugging Face config."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# Families whose attention normalises q and k per head before RoPE (Qwen3's q_norm / k_norm). Llama,
# Mistral, Qwen2 and the rest have no such norm: qk_norm is neither compiled nor tuned for them.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Why a float32 model gets so little: said wherever a command finds one.
FP32_NOTE = ("its torch_dtype is float32: rosekernels' GEMM and attention kernels take bfloat16 and float16 only "
             "(a float32 model runs them on torch), so only its norms have kernels; to serve it in bfloat16, "
             "set \"torch_dtype\": \"bfloat16\" in a copy of the config")
_LAYOUT = "a decoder config in the Llama / Qwen layout (hidden_size, num_attention_heads, intermediate_size, ...)"


@dataclasses.dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    intermediate: int
    heads_q: int
    heads_kv: int
    head_dim: int
    experts: int = 0  # 0: a dense MLP
    topk: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = True  # the router renormalises its top-k weights (norm_topk_prob; Mixtral always does)
    dtype: str = "bf16"
    qk_norm: bool = True  # per-head RMSNorm of q and k; from_config sets it from the model family
    # The FP8 weight scheme its linear layers run in ("none", or rosekernels.fp8.WEIGHT_SCHEMES' "tensor",
    # "channel", "block"): set by rosekernels.hf.apply(fp8=...) for its warm-up, never read from a config.
    fp8: str = "none"
    fp8_kv: bool = False  # an e4m3 KV cache (rosekernels.hf.apply(fp8_kv_cache=True)), likewise never from a config

    @classmethod
    def from_config(cls, config: Any) -> "ModelDims":
        """From a Hugging Face config: a `PretrainedConfig`, a dict, or the path of a config.json.
        A config this cannot read raises ValueError naming the file (or "model config") and the key;
        a file that cannot be opened raises OSError."""
        where = "model config"
        if isinstance(config, (str, os.PathLike)):
            where = os.fspath(config)
            with open(config) as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON: {e}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{where}: a model config is a JSON object, this file holds a {type(config).__name__}")
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        family = get("model_type")

        def size(key: str, *fallbacks: str, required: bool = False, default: int = 0) -> int:
            """The first of `key`, `fallbacks` the config sets, a positive int (an optional key's null or
            0 counts as unset: configs write "num_experts": 0 or "head_dim": null for none)."""
            for k in (key, *fallbacks):
                value = get(k)
                if value is None or (value == 0 and not required and not isinstance(value, bool)):
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{where}: {k} must be a positive integer, got {value!r}")
                return value
            if required:
                kind = f"model_type {family!r}" if family else "no model_type"
                raise ValueError(f"{where} ({kind}): no {key}: rosekernels reads {_LAYOUT}")
            return default

        hidden, heads = size("hidden_size", required=True), size("num_attention_heads", required=True)
        heads_kv = size("num_key_value_heads", default=heads)
        if heads % heads_kv:
            raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {heads_kv}")
        head_dim = size("head_dim")
        if not head_dim and hidden % heads:
            raise ValueError(f"{where}: no head_dim, and hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}")
        experts = size("num_experts", "n_routed_experts", "num_local_experts")
        topk = size("num_experts_per_tok")
        if experts and not topk:
            raise ValueError(f"{where}: {experts} experts but no num_experts_per_tok")
        if topk > experts > 0:
            raise ValueError(f"{where}: num_experts_per_tok {topk} is more than the {experts} experts")
        dtype = str(get("torch_dtype") or get("dtype") or "bfloat16").replace("torch.", "")
        if dtype not in DTYPES:
            raise ValueError(f"{where}: torch_dtype {dtype!r}: rosekernels' kernels take {', '.join(DTYPES)}")
        return cls(
            name=str(get("_name_or_path") or family or "model"),
            hidden=hidden,
            intermediate=size("intermediate_size"),
            heads_q=heads,
            heads_kv=heads_kv,
            head_dim=head_dim or hidden // heads,
            experts=experts,
            topk=topk if experts else 0,
            moe_intermediate=size("moe_intermediate_size"),
            norm_topk=bool(get("norm_topk_prob", True)),
            dtype=DTYPES[dtype],
            qk_norm=family in QK_NORM_FAMILIES,
        )


QWEN3_8B = ModelDims("qwen3-8b", 4096, 12288, 32, 8, 128)
QWEN3_30B_A3B = ModelDims("qwen3-30b-a3b", 2048, 6144, 32, 4, 128, experts=128, topk=8, moe_intermediate=768)
