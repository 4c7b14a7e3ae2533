"""The kernel-module contract: the names every module in `rosekernels.kernels` (listed in
`rosekernels.kernels.KERNELS`, found with `rosekernels.kernels.kernel_module(name)`) defines, so
that warm-up, tests and the tuner treat every kernel alike.

    OP                       the kernel's name: its key in KERNELS, the op of its variants
                             (`Config.OP`), its folder in the tuned store.
    Config                   a frozen dataclass on `KernelConfig`: everything one launch is
                             specialised on. Its compile-time fields make `variant()` (the compile
                             and tuned-store key; `Config.from_variant(v)` inverts it); its
                             POLICY_FIELDS (grid, split counts) are launch policy, which one compiled
                             kernel takes at run time. `validate()` refuses a config the kernel cannot
                             compile (the constructor calls it).
    Shape                    frozen dataclass of the problem sizes and options a call has (token count,
                             heads, hidden size, dtype, ...), `pdl` among them where the kernel launches
                             with programmatic dependent launch (the op's enable_pdl: config_for passes
                             it into the config). `Shape.of(...)` is the shape of an op's validated
                             arguments; `Shape.defaults(mode)` the shape `sip-tune --mode` tunes when no
                             --shape is given; `Shape.SIZE_FIELDS` names the fields that vary from call
                             to call (token or row counts, sequence lengths): `bucket` rounds them to
                             group shapes for the tuned store.
    config_for(shape, sms)   today's heuristic choice for `shape` on a GPU of `sms` SMs (None: the
                             current device's; it decides the mode).
    candidates(shape, sms)   every legal Config that can serve `shape`: the autotuner's search space
                             (the heuristic's choice among them).
    rank(shape, configs, sms)
                             `configs` (candidates of `shape`) best first by the kernel's cost model, for
                             the tuner's pruning; `keep_order` where the kernel has none.
    compile(config)          the loaded kernel (`jit.CompiledKernel`), from the compile caches.
    precompile(configs, processes)
                             compile() of each config (None: variants_for()), the cold ones first in
                             parallel processes (`jit.precompile`).
    variants_for(models, modes, max_tokens)
                             the Configs that models (`rosekernels.models.ModelDims`; None: the
                             library's default coverage) need at warm-up, for the given modes and
                             calls of at most max_tokens tokens (None: any; kernels whose variants do
                             not depend on the token count take it and list the same set).
    workload(config, shape)  a `rosekernels.workload.Workload`: inputs of `shape`, outputs, the float64
                             check and the launch of `config`'s kernel, for tests and the tuner.

Configs, shapes, heuristics and cost models live in the kernel's plan module (`<kernel>_plan.py`), which
imports neither CuTeDSL nor the device code, so they are tested and swept on a CPU without compiling.
The op that launches the kernel is in rosekernels/ops.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any, ClassVar, Iterable, Mapping

from rosekernels.variant import Variant

NAMES = ("OP", "Config", "Shape", "config_for", "candidates", "rank", "compile", "precompile", "variants_for",
         "workload")
SHAPE_NAMES = ("SIZE_FIELDS", "defaults", "of")


def missing(module: ModuleType) -> list[str]:
    """The contract names `module` does not define (`Shape.of`: one its Shape lacks; `Config`: a Config
    not on KernelConfig)."""
    found = [n for n in NAMES if not hasattr(module, n)]
    if hasattr(module, "Shape"):
        found += [f"Shape.{n}" for n in SHAPE_NAMES if not hasattr(module.Shape, n)]
    if hasattr(module, "Config") and not issubclass(module.Config, KernelConfig):
        found.append("Config")
    return found


class KernelConfig:
    """The base of every kernel's Config (a frozen dataclass): `variant()` and `from_variant()` derived
    from the fields and what the class declares.

    OP             the kernel's op name (the variant's first part).
    mode           "prefill" or "decode": a field, a property or a class attribute.
    POLICY_FIELDS  launch policy: fields the variant leaves out (one compiled kernel takes every value).
    KEY_NAMES      field -> its name in the variant, where the two differ.
    KEY_DEFAULTS   field -> the value at which the variant leaves it out: a field added after variants
                   were first compiled and cached leaves their keys as they were while it has its
                   default. A callable default is called with the config (a default that depends on
                   other fields). from_variant gives a field the variant leaves out its dataclass
                   default, so the two must agree.
    """

    OP: ClassVar[str]
    POLICY_FIELDS: ClassVar[tuple[str, ...]] = ()
    KEY_NAMES: ClassVar[Mapping[str, str]] = {}
    KEY_DEFAULTS: ClassVar[Mapping[str, Any]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless the kernel can compile this config."""

    def variant(self) -> Variant:
        params = {}
        for f in dataclasses.fields(self):
            if f.name == "mode" or f.name in self.POLICY_FIELDS:
                continue
            value = getattr(self, f.name)
            if f.name in self.KEY_DEFAULTS:
                default = self.KEY_DEFAULTS[f.name]
                if value == (default(self) if callable(default) else default):
                    continue
            params[self.KEY_NAMES.get(f.name, f.name)] = value
        return Variant.of(self.OP, self.mode, **params)

    @classmethod
    def from_variant(cls, variant: Variant) -> Any:
        """The config of `variant`, its launch policy at the defaults."""
        if variant.op != cls.OP:
            raise ValueError(f"not {'an' if cls.OP[0] in 'aeiou' else 'a'} {cls.OP} variant: {variant.key()}")
        fields = {key: name for name, key in cls.KEY_NAMES.items()}
        params = {fields.get(key, key): value for key, value in variant.params}
        if "mode" in {f.name for f in dataclasses.fields(cls)}:
            params["mode"] = variant.mode
        config = cls(**params)
        if config.mode != variant.mode:
            raise ValueError(f"{variant.key()}: its parameters make a {config.mode} config")
        return config


def keep_order(shape: Any, configs: Iterable[Any], sms: int | None = None) -> list[Any]:
    """The `rank` of a kernel without a cost model: the candidates' own order."""
    return list(configs)


def shape_with(shape: Any, overrides: Mapping[str, Any]) -> Any:
    """`shape` with some fields replaced (e.g. from `sip-tune --shape k=v,...`); unknown keys, values
    of another kind and sizes below 1 are errors that name the key."""
    known = {f.name for f in dataclasses.fields(shape)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown shape keys {unknown}; {type(shape).__name__} takes {sorted(known)}")
    for name, value in overrides.items():
        current = getattr(shape, name)
        if current is not None and not _same_kind(value, current):
            raise ValueError(f"shape key {name}={value!r}: expected a {type(current).__name__}")
        if type(current) is int and value < 1:  # every int field of a Shape is a size or a count
            raise ValueError(f"shape key {name}={value!r}: sizes are at least 1")
    return dataclasses.replace(shape, **overrides)


def _same_kind(value: Any, current: Any) -> bool:
    """Whether `value` may replace `current` (an int where a float is expected, never a bool for a number)."""
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(current))


def bucket(shape: Any) -> Any:
    """`shape` with each of its class's SIZE_FIELDS raised to the next power of two (0 and 1 stay):
    the shapes one tuned-config entry serves. Every other field (heads, dims, dtype, options) is
    kept exactly, since it changes what the kernel computes, not only how much."""
    return dataclasses.replace(shape, **{name: _next_pow2(getattr(shape, name)) for name in type(shape).SIZE_FIELDS})


def _next_pow2(n: int) -> int:
    return n if n <= 1 else 1 << (int(n) - 1).bit_length()
