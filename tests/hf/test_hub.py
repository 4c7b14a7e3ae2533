"""rosekernels.hub: rosekernels' RMSNorm through Hugging Face's `kernels` layer interface. On a CPU,
`kernels.kernelize` with the repository's mapping swaps every norm of a Qwen3 model (q_norm and k_norm
included) for the layer, which calls a stand-in for the device kernel with the kernel's contract
(float64 math, one rounding) and otherwise falls back to exactly the stock forward; on the GPU the
real kernel runs, through `kernels` directly and through transformers' KernelConfig."""
import copy
import os
import random

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("kernels", reason="pip install 'rosekernels[kernels]'")

import kernels  # noqa: E402
import rosekernels  # noqa: E402
from kernels import Mode, kernelize, use_kernel_mapping  # noqa: E402
from rosekernels import hf, hub  # noqa: E402
from rosekernels.hub import layers  # noqa: E402
from transformers import Qwen3Config  # noqa: E402


def _config(rng: random.Random, layers_: int) -> Qwen3Config:
    heads_kv = rng.choice((1, 2))
    return Qwen3Config(hidden_size=8 * rng.randint(8, 40), intermediate_size=8 * rng.randint(8, 60),
                       num_attention_heads=heads_kv * rng.choice((1, 2, 4)), num_key_value_heads=heads_kv,
                       head_dim=rng.choice((64, 128)), vocab_size=rng.randint(50, 300), num_hidden_layers=layers_,
                       rms_norm_eps=rng.choice((1e-6, 1e-5)))


def _norms(model):
    return [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What rosekernels.rmsnorm computes: the norm in wide math, times the weight, rounded once."""
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


def test_the_folder_is_a_kernels_layer_repository():
    loaded = kernels.get_local_kernel(hub.REPOSITORY)
    assert loaded.layers.RMSNorm is layers.RMSNorm  # the repository's module re-exports rosekernels' layer
    assert set(hub.mapping("cuda")) == set(hub.LAYERS) == {"RMSNorm"}


@pytest.fixture
def stand_in(monkeypatch):
    """The layer's calls on CPU tensors go to a float64 stand-in for the device kernel; the calls' norm
    widths and eps are recorded."""
    calls = []

    def rmsnorm(x, weight, eps):
        calls.append((x.shape[-1], eps))
        return _reference(x, weight, eps)

    monkeypatch.setattr(rosekernels, "rmsnorm", rmsnorm)
    return calls


def _kernelized(seed: int, n_layers: int):
    rng = random.Random(seed)
    config = _config(rng, n_layers)
    stock = hf.random_model(config, seed=seed, device="cpu", dtype=torch.float32)
    model = copy.deepcopy(stock)
    with use_kernel_mapping(hub.mapping("cpu")):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    ids = torch.randint(0, config.vocab_size, (rng.randint(1, 3), rng.randint(1, 9)))
    return config, stock, model, ids


def test_kernelize_routes_every_norm_of_a_qwen3_model_through_the_layer(stand_in, monkeypatch):
    monkeypatch.setattr(layers, "_takes", lambda x, w: True)  # CPU tensors stand in for an sm_90 GPU's
    n_layers = random.randint(1, 3)
    config, stock, model, ids = _kernelized(int.from_bytes(os.urandom(4), "little"), n_layers)
    norms = _norms(model)
    assert len(norms) == 4 * n_layers + 1  # two per layer, q_norm and k_norm, the final one
    assert all(m.forward.__func__ is layers.RMSNorm.forward for m in norms)
    with torch.no_grad():
        got, want = model(ids).logits, stock(ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()
    # every norm ran once, the per-head ones over head_dim, each with the model's eps
    widths = sorted(w for w, _ in stand_in)
    assert widths == sorted([config.hidden_size] * (2 * n_layers + 1) + [config.head_dim] * (2 * n_layers))
    assert {eps for _, eps in stand_in} == {config.rms_norm_eps}


def test_a_call_the_kernel_does_not_take_runs_exactly_the_stock_forward(stand_in):
    _, stock, model, ids = _kernelized(int.from_bytes(os.urandom(4), "little"), 1)
    assert all(m.forward.__func__ is layers.RMSNorm.forward for m in _norms(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)  # CPU tensors: the stock forward, bit for bit
    assert stand_in == []


@pytest.mark.gpu
def test_on_the_gpu_every_norm_runs_rosekernels_and_matches_the_reference(monkeypatch):
    from transformers import KernelConfig

    rng = random.Random(os.urandom(8))
    config = _config(rng, 2)
    stock = hf.random_model(config, seed=rng.randrange(1 << 30))  # bf16 on the GPU
    ran = []
    real = rosekernels.rmsnorm
    monkeypatch.setattr(rosekernels, "rmsnorm", lambda x, w, eps: ran.append(x.shape[-1]) or real(x, w, eps=eps))
    for route in ("kernels", "transformers"):
        model = copy.deepcopy(stock)
        if route == "kernels":
            with use_kernel_mapping(hub.mapping()):
                kernelize(model, mode=Mode.INFERENCE, device="cuda")
        else:
            model.set_use_kernels(True, KernelConfig({"RMSNorm": f"{hub.REPOSITORY}:RMSNorm"}, use_local_kernel=True))
        norms = _norms(model)
        assert all(m.forward.__func__ is layers.RMSNorm.forward for m in norms), route
        for m in norms:  # each against its float64 reference on fresh rows, the output poisoned by nothing
            x = torch.randn(rng.randint(1, 300), m.weight.shape[0], device="cuda", dtype=torch.bfloat16)
            ran.clear()
            got = m(x)
            assert ran == [x.shape[-1]] and got.dtype == x.dtype
            want = _reference(x, m.weight, m.variance_epsilon).double()
            assert ((got.double() - want).abs() / (1 + want.abs())).max().item() < 8e-3, route
        ids = torch.randint(0, config.vocab_size, (2, rng.randint(2, 40)), device="cuda")
        with torch.no_grad():
            got, want = model(ids).logits.float(), stock(ids).logits.float()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cos.min().item() > 0.999, route
    # What the kernel does not take runs the stock forward: an fp32 weight with bf16 input (stock returns
    # fp32), a width that is not a multiple of 16 bytes.
    norm = _norms(model)[0]
    ran.clear()
    with torch.no_grad():
        norm.weight.data = norm.weight.data.float()
        x = torch.randn(3, norm.weight.shape[0], device="cuda", dtype=torch.bfloat16)
        assert norm(x).dtype == torch.float32 and ran == []
        odd = copy.deepcopy(norm)
        odd.weight.data = torch.randn(12, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(5, 12, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(odd(x), type(odd).forward(odd, x)) and ran == []
