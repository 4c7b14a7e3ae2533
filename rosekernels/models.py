"""The dimensions of a transformer that decide which kernels it needs, from a Hugging Face config."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


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
    dtype: str = "bf16"

    @classmethod
    def from_config(cls, config: Any) -> "ModelDims":
        """From a Hugging Face config: a `PretrainedConfig`, a dict, or the path of a config.json."""
        if isinstance(config, (str, os.PathLike)):
            with open(config) as f:
                config = json.load(f)
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        dtype = str(get("torch_dtype") or get("dtype") or "bfloat16").replace("torch.", "")
        return cls(
            name=str(get("_name_or_path") or get("model_type") or "model"),
            hidden=hidden,
            intermediate=int(get("intermediate_size") or 0),
            heads_q=heads,
            heads_kv=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            experts=int(get("num_experts") or get("n_routed_experts") or get("num_local_experts") or 0),
            topk=int(get("num_experts_per_tok") or 0),
            moe_intermediate=int(get("moe_intermediate_size") or 0),
            dtype={"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, "bf16"),
        )


QWEN3_8B = ModelDims("qwen3-8b", 4096, 12288, 32, 8, 128)
QWEN3_30B_A3B = ModelDims("qwen3-30b-a3b", 2048, 6144, 32, 4, 128, experts=128, topk=8, moe_intermediate=768)
