"""A kernel module that follows the kernel-module contract (rosekernels.contract) around the tiny jit
demo kernel (y = 2x + 1): warm-up and sip-tune's workload builder are tested with it on the CPU,
independently of the package's own kernels. Register it for a test with
`monkeypatch.setitem(rosekernels.KERNELS, axpb_kernel.OP, "axpb_kernel")`."""
from __future__ import annotations

import dataclasses
import math
import random

import jit_demo_kernel as demo

from rosekernels import jit
from rosekernels.variant import MODES, Variant
from rosekernels.workload import Workload

OP = "axpb_test"
DECODE_MAX_N = 4096  # one wave of blocks: the decode variant serves up to this length


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str
    dtype: str = "fp32"

    def variant(self) -> Variant:
        return Variant.of(OP, self.mode, dtype=self.dtype)

    @classmethod
    def from_variant(cls, variant: Variant) -> "Config":
        return cls(variant.mode, **dict(variant.params))


@dataclasses.dataclass(frozen=True)
class Shape:
    n: int
    dtype: str = "fp32"

    @classmethod
    def defaults(cls, mode: str) -> "Shape":
        if mode not in MODES:
            raise ValueError(f"axpb: no {mode!r} mode")
        return cls(1000 if mode == "decode" else 1 << 20)


def config_for(shape: Shape, sms: int | None = None) -> Config:
    return Config("decode" if shape.n <= DECODE_MAX_N else "prefill", shape.dtype)


def candidates(shape: Shape, sms: int | None = None) -> list[Config]:
    return [config_for(shape)]


def compile(config: Config) -> jit.CompiledKernel:
    return jit.compile_variant(config.variant(), demo.build)


def variants_for(models=None, modes=MODES, max_tokens=None) -> list[Config]:
    return [Config(mode) for mode in modes]


def workload(config: Config, shape: Shape) -> Workload:
    import torch

    def make_args(seed: int, n: int = shape.n) -> tuple:
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(n, device="cuda", generator=g)
        return x, torch.full_like(x, math.nan)

    def check(args: tuple) -> float:
        x, y = args
        err = (y.double() - (2 * x.double() + 1)).abs().max().item()
        assert err <= 1e-6, err
        return err

    def test_args(seed: int) -> tuple:  # ragged lengths the config serves
        top = DECODE_MAX_N if config.mode == "decode" else 3 * DECODE_MAX_N
        return make_args(seed, random.Random(seed).randint(1, top))

    return Workload(compile(config), make_args, outputs=lambda a: a[1:], check=check, test_args=test_args)
