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
- the tests of earlier suite calls asked for on the GPU host (--state: their gpu_suite_state.json.gz, whose
  "variants" the suite records test by test): the configs tests build inside their bodies, which collection
  cannot see (a recorded variant this source no longer builds is left out, and counted);
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




def _job(d: dict) -> tuple[object, object]:
    """(compile, config) of a variant given as Variant.as_dict(): a kernel module's, or a MoE peer kernel's
    (moe_peer, outside the registry). TypeError, ValueError or KeyError for a variant this source no longer
    builds (a state recorded at an older commit)."""
    from rosekernels.kernels import KERNELS, kernel_module
    from rosekernels.kernels import moe_peer
    from rosekernels.variant import Variant

    if d["op"] in KERNELS:
        module = kernel_module(d["op"])
        return module.compile, module.Config.from_variant(Variant.from_dict(d))
    if d["op"].startswith("moe_") and d["mode"] == "decode":
        return moe_peer.compile, moe_peer.PeerConfig(op=d["op"][len("moe_"):], **d["params"])
    raise KeyError(f"no kernel builds op {d['op']!r}")


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
    return gpu_suite.collect(root, sys.executable, gpu_suite.SELECT, "sample" if sample else "full",
                             listing_env="GPU_SUITE_SPECS")


def state_variants(path: str) -> list[dict]:
    state = json.loads(gzip.decompress(Path(path).read_bytes()))
    return list(state.get("variants", {}).values())


def pack(cache: Path, keys: set[str], out: Path) -> tuple[int, list[Path]]:
    """The entries of `keys` at this source and toolchain, as out/compile_cache.tar.xz.NN parts."""
    from rosekernels import jit

    digest = jit.package_digest()
    entries = [e for e in jit.disk_entries(cache) if e.toolchain == jit.TOOLCHAIN and e.digest == digest
               and e.key in keys and e.object_path.is_file() and e.meta_path.is_file()]  # whole entries only
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
    dropped = []
    for d in given:
        try:
            jobs.append(_job(d))
        except (TypeError, ValueError, KeyError) as e:
            dropped.append(f"{d.get('op')}: {e}")
    unique = {cfg.variant().key(): (compile_config, cfg) for compile_config, cfg in jobs}
    print(f"gpu_precache: {len(unique)} variants ({len(given)} from the tests and states); compiling the cold ones "
          f"into {cache}", flush=True)
    if dropped:
        print(f"gpu_precache: {len(dropped)} recorded variants this source no longer builds, left out (first: "
              f"{dropped[0]})", file=sys.stderr)
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
