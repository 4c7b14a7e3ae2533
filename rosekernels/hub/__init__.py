"""rosekernels' layers for Hugging Face's `kernels` package: this folder is a local layer repository.

transformers declares its RMSNorm classes with `use_kernel_forward_from_hub("RMSNorm")` (Qwen3RMSNorm,
which Qwen3's q_norm and k_norm are too; Qwen3-MoE's, Llama's, ...), and `kernels.kernelize` swaps
the forward of every such module for the layer a mapping names. This repository's layer "RMSNorm"
runs rosekernels.rmsnorm on an sm_90 GPU and the module's own forward for anything the kernel does not
take (another device, dtype or width; a weight in another dtype than the input):

    from kernels import Mode, kernelize, use_kernel_mapping
    from rosekernels import hub

    with use_kernel_mapping(hub.mapping()):
        kernelize(model, mode=Mode.INFERENCE, device="cuda")

or in transformers, `KernelConfig({"RMSNorm": f"{hub.REPOSITORY}:RMSNorm"}, use_local_kernel=True)`
with `from_pretrained(..., use_kernels=True, kernel_config=...)`. Needs `pip install 'rosekernels[kernels]'`
(kernels 0.16: the range transformers 5.17 accepts). Nothing is downloaded.

RMSNorm is the one layer of this interface rosekernels has a kernel for in Qwen3, Qwen3-MoE and Llama
(their other hook, rotary_pos_emb, it has none for); rosekernels.hf.apply replaces more (attention, the
projections, the MLP, the experts), without `kernels`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rosekernels.hub import layers  # noqa: F401  (what `kernels` reads: layers.<name>)

REPOSITORY = Path(__file__).resolve().parent  # holds metadata.json, as `kernels` expects of a repository
LAYERS = ("RMSNorm",)


def mapping(device: str = "cuda") -> dict[str, Any]:
    """The kernel mapping of this repository's layers for `kernels.use_kernel_mapping` or
    `kernels.register_kernel_mapping`, on `device` ("cuda"; tests use "cpu")."""
    from kernels import LocalLayerRepository

    return {name: {device: LocalLayerRepository(repo_path=REPOSITORY, layer_name=name)} for name in LAYERS}
