"""SHA-256 of the cubin of every specialization the kernels' `variants_for()` lists, compiled for
sm_90a (no GPU needed), as JSON {variant key: sha256}; with --compare, the keys whose cubin differs
from an earlier run's (a refactoring that must not change any kernel shows none).

    python tools/cubin_hashes.py -o hashes.json [--kernels qk_norm,rmsnorm] [--compare before.json] [-j 2]
    python tools/cubin_hashes.py -o keys.json --keys-only [--extras]        # every key, nothing compiled
    python tools/cubin_hashes.py -o sample.json --only REGEX [--extras]     # the keys REGEX finds in
    python tools/cubin_hashes.py -o sample.json --sample tools/cubin_sample.txt --extras    # 60, every family

--extras adds the kernels warm-up does not list by default: the KV-cache variants of the split-KV kernel
(contiguous and 16-row pages), the varlen prefill variants and the MoE peer kernels. --keys-only writes
null for every hash; --compare then compares the key lists. --sample FILE takes the regular expressions
of FILE's lines (# comments) as --only does their alternation. With --only or --sample, --compare looks
only at the earlier run's keys they find (compare runs made with the same --kernels and --extras).
A path ending in .gz is read and written gzip-compressed (the committed lists in bench/results/sip are).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import gzip
import json
import multiprocessing
import os
import re
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# The kernels of this checkout, not those of an installed copy (an editable install points elsewhere).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

def _open(path: str, mode: str):
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def _module(name: str):
    from rosekernels.kernels import kernel_module

    return kernel_module(name)


def _extras(kernels: list[str]) -> list[tuple[object, object]]:
    """(compile, config) of the variants that no `variants_for()` lists."""
    specs = []
    if "attention_decode" in kernels:
        m = _module("attention_decode")
        specs += [(m.compile, c) for block_size in (None, 16) for c in m.kvcache_variants_for(block_size=block_size)]
    if "attention" in kernels:
        m = _module("attention")
        specs += [(m.compile, c) for c in m.varlen_variants_for()]
    if "moe_dispatch" in kernels or "moe_combine" in kernels:
        from rosekernels.kernels import moe_peer as peer

        configs = [peer.PeerConfig("ep_send", 4, hidden=2048, topk=8, experts=32),
                   peer.PeerConfig("ep_return", 4, hidden=2048, topk=8, experts=32),
                   peer.PeerConfig("wait", 4, region=peer.EP_FLAG, bump=True),
                   peer.PeerConfig("tp_reduce", 4, hidden=2048),
                   peer.PeerConfig("tp_reduce", 4, hidden=2048, topk=8)]
        specs += [(peer.compile, c) for c in configs]
    return specs


def every_spec(kernels: list[str], extras: bool) -> list[tuple[object, object]]:
    """(compile, config) of each variant: a spawned worker unpickles the compile by its module and name."""
    specs = [(_module(name).compile, cfg) for name in kernels for cfg in _module(name).variants_for()]
    return specs + (_extras(kernels) if extras else [])


def _hash(spec: tuple[object, object]) -> tuple[str, str]:
    compile_config, cfg = spec
    kernel = compile_config(cfg)
    return kernel.variant.key(), kernel.cubin_sha256


def main() -> int:
    from rosekernels.kernels import KERNELS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--compare", help="an earlier run's JSON: report keys missing, added or changed")
    p.add_argument("--keys-only", action="store_true", help="list the variant keys, compile nothing")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--only", metavar="REGEX", help="compile only the keys this regular expression finds in")
    only.add_argument("--sample", metavar="FILE", help="--only with each line of FILE an alternative")
    p.add_argument("--extras", action="store_true", help="also the KV-cache, varlen and MoE peer variants")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    specs = every_spec(args.kernels.split(","), args.extras)
    ops = {cfg.variant().op for _, cfg in specs}
    if args.sample:
        with open(args.sample) as f:
            args.only = "|".join(f"(?:{line.strip()})" for line in f if line.strip() and not line.startswith("#"))
    selected = re.compile(args.only) if args.only else None
    if selected is not None:
        specs = [s for s in specs if selected.search(s[1].variant().key())]
    if args.keys_only:
        hashes = {cfg.variant().key(): None for _, cfg in specs}
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            hashes = dict(pool.map(_hash, specs))
    with _open(args.output, "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    print(f"{len(hashes)} {'keys' if args.keys_only else 'cubins'} -> {args.output}")
    if not args.compare:
        return 0
    with _open(args.compare, "r") as f:
        before = {k: v for k, v in json.load(f).items()
                  if k.split("-")[0] in ops and (selected is None or selected.search(k))}
    changed = sorted(k for k in hashes.keys() & before.keys()
                     if None not in (hashes[k], before[k]) and hashes[k] != before[k])
    for label, keys in (("missing", sorted(before.keys() - hashes.keys())),
                        ("added", sorted(hashes.keys() - before.keys())), ("changed", changed)):
        for k in keys:
            print(f"{label}: {k}")
    same = not changed and before.keys() == hashes.keys()
    print("identical" if same else "DIFFERENT", f"({len(hashes)} now, {len(before)} before)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
