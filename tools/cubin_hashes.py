"""SHA-256 of the cubin of every specialization the kernels' `variants_for()` lists, compiled for
sm_90a (no GPU needed), as JSON {variant key: sha256}; with --compare, the keys whose cubin differs
from an earlier run's (a refactoring that must not change any kernel shows none).

    python tools/cubin_hashes.py -o hashes.json [--kernels qk_norm,rmsnorm] [--compare before.json] [-j 2]

A path ending in .gz is read and written gzip-compressed (the committed lists in bench/results are).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import importlib
import json
import multiprocessing
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _open(path: str, mode: str):
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def _specs(kernels: list[str]) -> list[tuple[str, object]]:
    import rosekernels

    return [(name, cfg) for name in kernels
            for cfg in importlib.import_module(rosekernels.KERNELS[name]).variants_for()]


def _hash(spec: tuple[str, object]) -> tuple[str, str]:
    import rosekernels

    name, cfg = spec
    kernel = importlib.import_module(rosekernels.KERNELS[name]).compile(cfg)
    return kernel.variant.key(), kernel.cubin_sha256


def main() -> int:
    import rosekernels

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--kernels", default=",".join(rosekernels.KERNELS))
    p.add_argument("--compare", help="an earlier run's JSON: report keys missing, added or changed")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    specs = _specs(args.kernels.split(","))
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        hashes = dict(pool.map(_hash, specs))
    with _open(args.output, "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    print(f"{len(hashes)} cubins -> {args.output}")
    if not args.compare:
        return 0
    with _open(args.compare, "r") as f:
        before = {k: v for k, v in json.load(f).items() if k.split("-")[0] in args.kernels.split(",")}
    changed = sorted(k for k in hashes.keys() & before.keys() if hashes[k] != before[k])
    for label, keys in (("missing", sorted(before.keys() - hashes.keys())),
                        ("added", sorted(hashes.keys() - before.keys())), ("changed", changed)):
        for k in keys:
            print(f"{label}: {k}")
    same = not changed and before.keys() == hashes.keys()
    print("identical" if same else "DIFFERENT", f"({len(hashes)} now, {len(before)} before)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
