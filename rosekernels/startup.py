"""Engine start-up: compile every specialization a model needs and load the SIP-tuned cubins.

    report = rosekernels.warmup(specs)      # then: no JIT on any call of these specializations
    print(report)

A spec is one specialization, given as any of
- a `rosekernels.jit.Variant` (e.g. `cfg.variant()`): compiled with its kernel module's
  `compile(Config.from_variant(variant))` (the module is `rosekernels.KERNELS[variant.op]`);
- a kernel Config (a dataclass with `.variant()`, e.g. from `qk_norm.variants_for()`): compiled with
  its kernel module's `compile(config)`;
- a zero-argument callable returning a `jit.CompiledKernel` (any other CuTeDSL kernel).

Tuned cubins come from the tuned store (`rosekernels.tuned`; `cache_dir` or $SIP_CACHE_DIR, else
<rosekernels cache>/sip). Each entry stores the original cubin it was tuned from, so it is installed
(`jit.install_tuned_cubin`) BEFORE compiling and swapped in when the kernel loads; the swap is keyed
by the original's SHA-256, so a tuned cubin never replaces a different original (a kernel whose source
or toolchain changed simply loads untuned, and the report says the entry is stale).

Tuned configs (`tuned.config_entries`: the level-1 winners of `sip-tune`) of the specs' kernels and
modes are compiled too, with the heuristic configs they were tuned against, so an op that plans a
shape of a tuned bucket loads them without compiling; the ops look them up under warmup's root from
then on (`tuned.use_config_root`). An entry whose heuristic no longer compiles to the cubin it was
tuned against is reported stale and not used.
"""
from __future__ import annotations

import dataclasses
import importlib
import time
import warnings
from types import ModuleType
from typing import Any, Callable, Iterable

import rosekernels
from rosekernels import jit, launch, tuned


@dataclasses.dataclass
class WarmupReport:
    tuned: list[str]  # variant keys loaded with a tuned cubin
    untuned: list[str]  # loaded as compiled
    stale: list[str]  # had a cache entry, but for another original cubin (re-tune them)
    seconds: float
    kernels: list[jit.CompiledKernel]
    configs: list[str] = dataclasses.field(default_factory=list)  # tuned-config entries in use
    stale_configs: list[str] = dataclasses.field(default_factory=list)  # tuned against another build

    def __str__(self) -> str:
        lines = [f"rosekernels.warmup: {len(self.kernels)} specializations in {self.seconds:.2f} s: "
                 f"{len(self.tuned)} tuned, {len(self.untuned)} untuned"]
        lines += [f"  tuned    {k}" for k in self.tuned]
        lines += [f"  untuned  {k}" + ("  (cache entry is stale: re-tune)" if k in self.stale else "")
                  for k in self.untuned]
        lines += [f"  config   {c}" for c in self.configs]
        lines += [f"  config   {c}  (stale: tuned against another build of its heuristic kernel: re-tune)"
                  for c in self.stale_configs]
        return "\n".join(lines)


def _module(op: str) -> ModuleType:
    if op not in rosekernels.KERNELS:
        raise ValueError(f"no kernel module for op {op!r}; the kernels are {sorted(rosekernels.KERNELS)}")
    return importlib.import_module(rosekernels.KERNELS[op])


def _resolve(spec: Any) -> tuple[jit.Variant | None, Callable[[], jit.CompiledKernel]]:
    """(the variant if known before compiling, how to compile it)."""
    if isinstance(spec, jit.Variant):
        m = _module(spec.op)
        config = m.Config.from_variant(spec)
        return spec, lambda: m.compile(config)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):  # a kernel Config
        variant = spec.variant()
        m = _module(variant.op)
        return variant, lambda: m.compile(spec)
    if callable(spec):
        return None, spec
    raise TypeError(f"a warmup spec is a Variant, a kernel config with .variant(), or a callable; got {spec!r}")


def warmup(specs: Iterable[Any], cache_dir: str | None = None) -> WarmupReport:
    """Compile (or load from the disk cache) every spec, with the SIP-tuned cubins found in the store."""
    t0 = time.perf_counter()
    tuned.use_config_root(cache_dir)
    launch.forget_plans()  # a plan made before now would keep the config it chose without the store
    resolved = [_resolve(s) for s in specs]
    n_specs = len(resolved)
    modes: dict[str, set[str]] = {}
    for variant, _ in resolved:
        if variant is not None:
            modes.setdefault(variant.op, set()).add(variant.mode)
    # Each tuned config follows the specs, after the heuristic config it was tuned against.
    configs = [e for op in sorted(modes) for e in tuned.config_entries(cache_dir, op) if e.meta["mode"] in modes[op]]
    resolved += [_resolve(c) for e in configs for c in (e.heuristic, e.config)]
    entries: dict[str, list[tuned.Entry]] = {}

    def install_for(variant: jit.Variant) -> None:
        if variant.key() not in entries:
            found = tuned.entries_for_variant(cache_dir, variant)
            entries[variant.key()] = found
            for e in sorted(found, key=lambda e: e.speedup):  # the best entry for an original wins
                jit.install_tuned_cubin(e.original, e.tuned)

    for variant, _ in resolved:
        if variant is not None:
            install_for(variant)
    kernels = [build() for _, build in resolved]
    # Specs known only once compiled, and variants loaded untuned before this call: reload them.
    reload = False
    for k in kernels:
        if k.variant.key() not in entries:
            install_for(k.variant)
        if not k.tuned and any(e.original == k.cubin for e in entries[k.variant.key()]):
            reload = True
    if reload:
        jit.forget_loaded()
        kernels = [build() for _, build in resolved]
    report = WarmupReport([], [], [], 0.0, kernels[:n_specs])
    for i, e in enumerate(configs):
        heuristic, config = kernels[n_specs + 2 * i: n_specs + 2 * i + 2]
        line = f"{e.meta['kernel']} {e.path.stem}: {heuristic.variant.key()} -> {config.variant.key()}"
        if heuristic.cubin_sha256 == e.original_sha256:
            report.configs.append(line)
        else:
            report.stale_configs.append(line)
            warnings.warn(f"rosekernels.warmup: tuned config {e.path} was tuned against another build of "
                          f"{heuristic.variant.key()} (the kernel or toolchain changed): not used; re-run sip-tune",
                          stacklevel=2)
    seen = {k.variant.key() for k in report.kernels}
    for k in kernels[n_specs:]:  # the configs' kernels, each listed once
        if k.variant.key() not in seen:
            seen.add(k.variant.key())
            report.kernels.append(k)
    for k in report.kernels:
        key = k.variant.key()
        if k.tuned:
            report.tuned.append(key)
            continue
        report.untuned.append(key)
        if entries.get(key):
            report.stale.append(key)
            warnings.warn(f"rosekernels.warmup: the SIP cache has entries for {key}, but for another original "
                          "cubin (the kernel or toolchain changed): loading it untuned; re-run sip-tune",
                          stacklevel=2)
    report.seconds = time.perf_counter() - t0
    return report
