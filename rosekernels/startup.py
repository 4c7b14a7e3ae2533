"""Engine start-up: compile every specialization a model needs and load the SIP-tuned cubins.

    report = rosekernels.warmup(model="config.json")     # what this Hugging Face model needs
    report = rosekernels.warmup(specs)                   # or these specializations
    print(report)                                        # then: no JIT on any call of them

The model form takes a `transformers` config object, a dict or the path of a config.json, and
compiles, for each kernel module, `variants_for([ModelDims.from_config(model)], modes, max_tokens)`; `max_tokens`
(the most tokens one forward pass carries) drops the specializations that only larger calls select.

Cold specializations (in neither the memory nor the disk cache) compile in parallel processes
(`jit.compile_cold`: one per core, as many as the available memory holds) with a progress bar; the
report says how many were compiled and how many loaded from disk. `cache_dir` is the compile cache's
root, as $ROSEKERNELS_CACHE_DIR (e.g. one built ahead of time by `rosekernels-cache build` on a machine
without a GPU), and `store_root` the tuned store's, as $SIP_CACHE_DIR; this process uses them from then
on (`rosekernels.paths` decides both).

A spec is one specialization, given as any of
- a `rosekernels.jit.Variant` (e.g. `cfg.variant()`): compiled with its kernel module's
  `compile(Config.from_variant(variant))` (the module is `rosekernels.kernels.kernel_module(variant.op)`);
- a kernel Config (a dataclass with `.variant()`, e.g. from `qk_norm.variants_for()`): compiled with
  its kernel module's `compile(config)`;
- a zero-argument callable returning a `jit.CompiledKernel` (any other CuTeDSL kernel).

Tuned cubins come from the tuned store (`rosekernels.tuned`; `store_root`, else $SIP_CACHE_DIR, else
<compile cache root>/sip), and only entries that meet the store's default bar (bitwise or the
kernel's own tolerance on >= 10^4 samples, compute-sanitizer clean, an op-level gain past the A/A
spread: `tuned.bar_problems`) load; `allow_unverified=True` (or $SIP_ALLOW_UNVERIFIED=1) loads weaker
ones too, for this process from then on (ops included). Entries below the bar are listed in the
report with the reason, and warned about once. Each entry stores the original cubin it was tuned
from, so it is installed (`jit.install_tuned_cubin`) BEFORE compiling and swapped in when the kernel
loads; the swap is keyed
by the original's SHA-256, so a tuned cubin never replaces a different original (a kernel whose source
or toolchain changed simply loads untuned, and the report says the entry is stale). Entries shipped with the
package (`tuned.SHIPPED_ROOT`: floors verified on an H200 at one shape, through the tuner's checks) load the
same way beside the store's (`shipped=False`: not); where both hold one original, the stronger, then faster wins.

Tuned configs (`tuned.config_entries`: the level-1 winners of `sip-tune`) whose heuristic config is
one of the specs (the only ones an op that plans a spec can be given: `warmup(model=...)` leaves the
entries of other models' shapes alone) are compiled too, so an op that plans a shape of a tuned
bucket loads them without compiling; the ops look them up under warmup's store root from then on
(`paths.tuned_store_root()`), and each warmup reads them afresh (another process may have tuned
since). An entry whose heuristic no longer compiles to the cubin it was
tuned against is reported stale and not used.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Iterable

import rosekernels.kernels
from rosekernels import jit, launch, paths, tuned
from rosekernels.models import ModelDims
from rosekernels.variant import MODES


@dataclasses.dataclass
class WarmupReport:
    tuned: list[str]  # variant keys loaded with a tuned cubin
    untuned: list[str]  # loaded as compiled
    stale: list[str]  # had a cache entry, but for another original cubin (re-tune them)
    seconds: float
    kernels: list[jit.CompiledKernel]
    configs: list[str] = dataclasses.field(default_factory=list)  # tuned-config entries in use
    stale_configs: list[str] = dataclasses.field(default_factory=list)  # tuned against another build
    compiled: list[str] = dataclasses.field(default_factory=list)  # variant keys this call compiled
    from_disk: list[str] = dataclasses.field(default_factory=list)  # loaded from the disk cache
    # The rest of `kernels` were loaded in this process before the call.
    # Entries below the default bar: "<entry>: <reasons>", and whether they were loaded (opted in).
    unverified: list[str] = dataclasses.field(default_factory=list)
    loaded_unverified: bool = False

    def __str__(self) -> str:
        before = len(self.kernels) - len(self.compiled) - len(self.from_disk)
        lines = [f"rosekernels.warmup: {len(self.kernels)} specializations in {self.seconds:.2f} s: "
                 f"{len(self.compiled)} compiled, {len(self.from_disk)} loaded from disk, {before} already loaded; "
                 f"{len(self.tuned)} tuned, {len(self.untuned)} untuned"]
        lines += [f"  tuned    {k}" for k in self.tuned]
        lines += [f"  untuned  {k}" + ("  (cache entry is stale: re-tune)" if k in self.stale else "")
                  for k in self.untuned]
        lines += [f"  config   {c}" for c in self.configs]
        lines += [f"  config   {c}  (stale: tuned against another build of its heuristic kernel: re-tune)"
                  for c in self.stale_configs]
        state = "loaded: allow_unverified" if self.loaded_unverified else "not loaded"
        lines += [f"  below the bar ({state})  {u}" for u in self.unverified]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Spec:
    variant: jit.Variant | None  # known before compiling, except for a callable spec
    build: Callable[[], jit.CompiledKernel]
    job: tuple[Callable[[Any], jit.CompiledKernel], Any] | None  # (compile, config): what a worker can build


def _resolve(spec: Any) -> _Spec:
    if isinstance(spec, jit.Variant):
        spec = rosekernels.kernels.kernel_module(spec.op).Config.from_variant(spec)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):  # a kernel Config
        variant = spec.variant()
        m = rosekernels.kernels.kernel_module(variant.op)
        return _Spec(variant, lambda: m.compile(spec), (m.compile, spec))
    if callable(spec):
        return _Spec(None, spec, None)
    raise TypeError(f"a warmup spec is a Variant, a kernel config with .variant(), or a callable; got {spec!r}")


def model_specs(model: Any, modes: Iterable[str] = MODES, max_tokens: int | None = None) -> list[Any]:
    """The configs of every kernel module that `model` (a Hugging Face config: object, dict or path of
    a config.json; or a ModelDims) needs in `modes`, for calls of at most `max_tokens` tokens (None:
    every token count the kernels warm up)."""
    modes = tuple(modes)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be some of {MODES}, got {modes!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    dims = model if isinstance(model, ModelDims) else ModelDims.from_config(model)
    return [c for op in rosekernels.kernels.KERNELS
            for c in rosekernels.kernels.kernel_module(op).variants_for([dims], modes, max_tokens)]


def warmup(specs: Iterable[Any] = (), *, model: Any = None, modes: Iterable[str] = MODES,
           max_tokens: int | None = None, cache_dir: str | os.PathLike | None = None,
           store_root: str | os.PathLike | None = None, processes: int | None = None,
           progress: bool = True, allow_unverified: bool | None = None, shipped: bool = True,
           tuned_dir: str | os.PathLike | None = None) -> WarmupReport:
    """Compile (or load from the disk cache) every spec, and what `model` needs in `modes` for calls
    of at most `max_tokens` tokens (`model_specs`), with the SIP-tuned cubins found in the store.

    cache_dir: the compile cache's root from now on (None: $ROSEKERNELS_CACHE_DIR, else the user
    cache dir). store_root: the tuned store's (None: $SIP_CACHE_DIR, else <cache root>/sip).
    processes: compile workers for the cold specializations (None: one per core, memory allowing).
    progress: a progress bar on a terminal while compiling. allow_unverified: also load tuned entries
    below the store's default bar, from now on in this process (None: $SIP_ALLOW_UNVERIFIED decides).
    shipped: also the tuned cubins shipped with the package (`tuned.SHIPPED_ROOT`), under the same bar.
    tuned_dir: deprecated, the former name of store_root."""
    t0 = time.perf_counter()
    if tuned_dir is not None:
        if store_root is not None:
            raise TypeError("warmup takes store_root or its deprecated name tuned_dir, not both")
        warnings.warn("warmup(tuned_dir=...) is deprecated: pass store_root=...", DeprecationWarning, stacklevel=2)
        store_root = tuned_dir
    specs = list(specs)
    if model is not None:
        specs += model_specs(model, modes, max_tokens)
    elif not specs:
        raise TypeError("warmup needs specs or model=")
    paths.use_compile_cache_root(cache_dir)
    paths.use_tuned_store_root(store_root)
    root = paths.tuned_store_root()
    if allow_unverified is not None:
        tuned.allow_unverified(allow_unverified)
    below_bar: list[str] = []  # for the report: entries found below the bar
    launch.forget_plans()  # a plan made before now would keep the config it chose without the store
    tuned.forget_configs()  # and the config entries read before now miss what was tuned since
    resolved = [_resolve(s) for s in specs]
    n_specs = len(resolved)
    wanted = {r.variant for r in resolved if r.variant is not None}

    def admitted(entry: tuned.Entry | tuned.ConfigEntry, name: str) -> bool:
        if entry.problems:
            below_bar.append(f"{name}: {'; '.join(entry.problems)}")
        return tuned.admitted(entry)

    # Each tuned config that an op planning a spec can be given (its heuristic is a spec) follows
    # the specs, after that heuristic config; other entries (other models' shapes) are left alone.
    configs = [e for op in sorted({v.op for v in wanted})
               for e in tuned.config_entries(root, rosekernels.kernels.kernel_module(op))
               if e.heuristic.variant() in wanted and admitted(e, f"config {e.meta['kernel']} {e.path.stem}")]
    resolved += [_resolve(c) for e in configs for c in (e.heuristic, e.config)]
    entries: dict[str, list[tuned.Entry]] = {}  # variant key -> the entries it may load
    roots = [root] + ([tuned.SHIPPED_ROOT] if shipped and tuned.SHIPPED_ROOT != root else [])

    def install_for(variant: jit.Variant) -> None:
        if variant.key() not in entries:
            found = [e for r in roots for e in tuned.entries_for_variant(r, variant) if admitted(e, variant.key())]
            entries[variant.key()] = found
            # the strongest, then fastest entry for an original wins (installed last)
            for e in sorted(found, key=lambda e: (tuned.strength(e.meta, "cubin"), e.speedup)):
                jit.install_tuned_cubin(e.original, e.tuned)

    for r in resolved:
        if r.variant is not None:
            install_for(r.variant)
    loaded_before = {k.variant for k in jit.loaded_variants()}
    compiled = set(jit.compile_cold([r.job for r in resolved if r.job is not None], processes, progress))
    for r in resolved:  # callables compile here, one after another
        if r.job is None:
            try:
                with jit.cached_only():
                    r.build()
            except jit.NotCached as cold:
                compiled.add(cold.args[0])
    kernels = [r.build() for r in resolved]
    # Specs known only once compiled, and variants loaded untuned before this call: reload them.
    reload = False
    for k in kernels:
        if k.variant.key() not in entries:
            install_for(k.variant)
        if not k.tuned and any(e.original == k.cubin for e in entries[k.variant.key()]):
            reload = True
    if reload:
        jit.forget_loaded()
        kernels = [r.build() for r in resolved]
    report = WarmupReport([], [], [], 0.0, kernels[:n_specs], unverified=below_bar,
                          loaded_unverified=tuned.unverified_allowed())
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
        if k.variant in compiled:
            report.compiled.append(key)
        elif k.variant not in loaded_before:
            report.from_disk.append(key)
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
