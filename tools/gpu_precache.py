#!/usr/bin/env python3
"""A compile cache for the GPU suite, built on the CPU host ahead of a call: a fresh GPU host otherwise spends
most of its first calls compiling, and this host compiles the same cubins with the same CuTeDSL build
(bench/results/sip/cubin_hashes.md), so device minutes go to running tests instead.

    python3 tools/gpu_precache.py --out .gpu_suite_in [--state gpu_suite_state.json.gz ...] [--sample] [-j N]

It compiles, into --cache (default: this user's compile cache), every kernel variant that
- a kernel's `variants_for()` lists, with the KV-cache, varlen and MoE peer extras (tools/cubin_hashes.py);
- `rosekernels.hf.warmup_specs` gives for each of hf.GEOMETRIES with every experts path, FP8 weight scheme
  and FP8 KV cache (the hf tests' models);
- the collected `gpu or grid` tests take as parameters (the grids whole, or as CI samples them: --sample);
- earlier suite calls loaded on the GPU host (--state: their gpu_suite_state.json.gz, whose "variants" the
  suite records test by test): the configs tests build inside their bodies, which collection cannot see;
then packs the entries of those variants, at this tree's source, as --out/compile_cache.tar.xz.NN parts
(tools/gpu_suite.py's format). Carry --out in the `.whl` call and pass the parts to the suite:
`tools/gpu_suite.sh --out "$OUT" --cache-in .gpu_suite_in/compile_cache.tar.xz.*`.

The cache key is the package source's digest: build at the commit the GPU call runs.
Exit status: 0 done, 1 a compile failed or the cache packs past what a call carries, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path[:0] = [str(TOOLS), str(ROOT)]  # this checkout's kernels and the suite's helpers

import cubin_hashes  # noqa: E402
import gpu_suite  # noqa: E402


def _variant(d: dict):
    from rosekernels.variant import Variant

    return Variant(d["op"], d["mode"], tuple(sorted(d["params"].items())), d.get("arch", "sm_90a"))


def _job(d: dict) -> tuple[object, object] | None:
    """(compile, config) of a variant given as Variant.as_dict(); None for an op with no kernel module of the
    registry (the MoE peer kernels: cubin_hashes' extras hold them)."""
    from rosekernels.kernels import KERNELS, kernel_module

    if d["op"] not in KERNELS:
        return None
    module = kernel_module(d["op"])
    return module.compile, module.Config.from_variant(_variant(d))


def hf_specs() -> list[tuple[object, object]]:
    """(compile, config) of what the hf tests' models launch, on every path hf.apply offers them."""
    from rosekernels import fp8 as fp8_math
    from rosekernels import hf
    from rosekernels.kernels import kernel_module

    specs = []
    for geometry in sorted(hf.GEOMETRIES):
        model = hf.random_model(geometry, 1, device="meta")
        experts = [None, "moe_experts"] if hf.GEOMETRIES[geometry].experts else [None]
        for path, scheme, kv in itertools.product(experts, [None, *fp8_math.WEIGHT_SCHEMES], (False, True)):
            for cfg in hf.warmup_specs(model, experts=path, fp8=scheme, fp8_kv_cache=kv):
                specs.append((kernel_module(cfg.variant().op).compile, cfg))
    return specs


def param_variants(sample: bool, root: Path = ROOT) -> list[dict]:
    """Variant.as_dict() of every kernel config the `gpu or grid` tests of `root` take as parameters."""
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "specs.json"
        env = gpu_suite.pytest_env(root, "sample" if sample else "full", {"GPU_SUITE_SPECS": str(listing)})
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-p", "gpu_suite_plugin", "-m", gpu_suite.SELECT], cwd=root, env=env,
                             capture_output=True, text=True)
        if run.returncode not in (0, 5) or not listing.exists():
            raise SystemExit(f"gpu_precache: collecting the tests failed:\n{(run.stdout + run.stderr)[-4000:]}")
        return json.loads(listing.read_text())


def state_variants(path: str) -> list[dict]:
    state = json.loads(gzip.decompress(Path(path).read_bytes()))
    return list(state.get("variants", {}).values())


def pack(cache: Path, keys: set[str], out: Path) -> tuple[int, list[Path]]:
    """The entries of `keys` at this source and toolchain, as out/compile_cache.tar.xz.NN parts."""
    from rosekernels import jit

    digest = jit.package_digest()
    entries = [e for e in jit.disk_entries(cache)
               if e.toolchain == jit.TOOLCHAIN and e.digest == digest and e.key in keys]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "jit" / jit.TOOLCHAIN
        folder.mkdir(parents=True)
        for e in entries:
            for path in (e.object_path, e.meta_path):
                shutil.copyfile(path, folder / path.name)
        for old in out.glob("compile_cache.tar.xz.*"):
            old.unlink()
        return len(entries), gpu_suite.pack_cache(Path(tmp), out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the compile_cache.tar.xz.NN parts go (e.g. .gpu_suite_in)")
    p.add_argument("--state", nargs="*", default=[], help="gpu_suite_state.json.gz of earlier GPU calls")
    p.add_argument("--sample", action="store_true", help="the grids as CI samples them (for a --sample suite)")
    p.add_argument("--cache", help="the compile cache to build in (default: $ROSEKERNELS_CACHE_DIR or the user's)")
    p.add_argument("-j", "--jobs", type=int, help="compile processes (default: one per core, memory allowing)")
    args = p.parse_args(argv)
    for path in args.state:
        if not Path(path).is_file():
            p.error(f"--state {path}: no such file")
    from rosekernels import jit, paths
    from rosekernels.kernels import KERNELS

    t0 = time.monotonic()
    paths.use_compile_cache_root(args.cache)
    cache = paths.compile_cache_root()
    jobs = cubin_hashes.every_spec(list(KERNELS), extras=True) + hf_specs()
    given = param_variants(args.sample) + [d for path in args.state for d in state_variants(path)]
    skipped = 0
    for d in given:
        job = _job(d)
        if job is None:
            skipped += 1
        else:
            jobs.append(job)
    unique = {cfg.variant().key(): (compile_config, cfg) for compile_config, cfg in jobs}
    print(f"gpu_precache: {len(unique)} variants ({len(given)} from the tests and states, {skipped} of ops "
          f"outside the kernel registry left to the extras); compiling the cold ones into {cache}", flush=True)
    compiled = jit.compile_cold(list(unique.values()), args.jobs, progress=True)
    packed, parts = pack(cache, set(unique), Path(args.out))
    size = sum(part.stat().st_size for part in parts)
    print(f"gpu_precache: {len(compiled)} compiled, {packed} entries packed in {len(parts)} part(s) of "
          f"{size / 2**20:.1f} MiB under {args.out}, in {time.monotonic() - t0:.0f} s")
    if packed != len(unique):
        print(f"gpu_precache: {len(unique) - packed} variants have no entry at this source", file=sys.stderr)
        return 1
    return 0 if parts else 1


if __name__ == "__main__":
    sys.exit(main())
