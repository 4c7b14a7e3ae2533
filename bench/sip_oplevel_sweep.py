"""Shipped SIP entries through the public op at other sequence lengths than the one they were timed at
(issue 40 (b)): one tuned cubin serves every call its variant launches, so its gain is only worth
what it gives over the lengths that variant serves.

    python bench/sip_oplevel_sweep.py [--entries DIR[=LABEL] ...] [--seqlens 2048,4096,8192]
        [--tokens 16384] [--heads 32/8] [--kernels d128,d128c,d64c] [--commit HASH] [--out DIR]

Each entry (default: the shipped store, rosekernels/tuned_entries; another root, e.g. a search's winners,
with --entries) is re-timed by sip_tune.oplevel.retime at each length: a fresh process, CUDA graphs,
inputs rotated past L2, the op with the original cubin twice (the A/A) and with the entry's, SDPA and FA4
(where importable) beside them. A length where the op would launch another variant (attention_plan.config_for
on this GPU) is recorded as such, not timed. batch = tokens // seqlen keeps the work per call alike.
An entry without original.cubin (a search's export) takes the shipped entry's of the same variant and
original, else this source's compile.

Results: sip_oplevel_sweep.json and .md in <out>/sip/sweeps (bench/report.py; --out bench/results: the committed ones).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import report  # noqa: E402  (bench/report.py: environment and result files)

NAMES = {"d128": (128, False), "d128c": (128, True), "d64c": (64, True), "d64": (64, False)}


def entries(root: Path, label: str, wanted: set[tuple[int, bool]]) -> list[dict]:
    """The dense attention entries under `root` whose (head_dim, causal) is wanted."""
    import rosekernels.kernels
    from rosekernels import tuned
    from rosekernels.variant import Variant

    found = []
    for meta_path in sorted(root.glob("*/attention/*/*/meta.json")):
        meta = json.loads(meta_path.read_text())
        variant = Variant.from_dict(meta["variant"])
        module = rosekernels.kernels.kernel_module(variant.op)
        config = module.Config.from_variant(variant)
        if (config.head_dim, config.causal) not in wanted:
            continue
        relative = meta_path.parent.relative_to(root)
        at = [p for p in (meta_path.parent, tuned.SHIPPED_ROOT / relative) if (p / "original.cubin").is_file()]
        original = (at[0] / "original.cubin").read_bytes() if at else module.compile(config).cubin
        found.append({"label": label, "path": str(relative), "variant": variant, "config": config,
                      "original": original, "tuned": (meta_path.parent / "tuned.cubin").read_bytes()})
    return found


def sweep(found: list[dict], seqlens: list[int], tokens: int, heads: tuple[int, int], sms: int) -> list[dict]:
    from rosekernels.kernels import attention_plan
    from sip_tune import oplevel

    rows = []
    for entry in found:
        config = entry["config"]
        for seqlen in seqlens:
            shape = attention_plan.AttentionShape(batch=max(1, tokens // seqlen), seqlen=seqlen, heads_q=heads[0],
                                                  heads_kv=heads[1], head_dim=config.head_dim, dtype=config.dtype,
                                                  causal=config.causal)
            row = {"entry": entry["label"], "variant": entry["variant"].key(), "shape": vars(shape).copy()}
            launched = attention_plan.config_for(shape, sms)
            if launched.variant().key() != entry["variant"].key():
                row["error"] = f"the op launches another variant here: {launched.variant().key()}"
            else:
                timing = oplevel.retime("attention", shape, oplevel.CubinCandidate(
                    entry["variant"], entry["original"], entry["tuned"]))
                row.update(timing.meta())
                row["error"] = timing.error
            print(json.dumps({k: row.get(k) for k in ("entry", "variant", "shape", "speedup", "aa_spread", "peer",
                                                       "vs_peer", "error")}), flush=True)
            rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Shipped SIP entries through the op across sequence lengths ({meta['gpu']}, {meta['date']})", "",
             f"`{meta['command']}` at {meta['commit']}: each row a fresh process (sip_tune.oplevel: CUDA graphs, "
             "inputs rotated past L2, the original cubin twice for the A/A, peers interleaved). speedup = "
             "original / tuned through the op; A/A = |original / original - 1|; peer = the fastest of SDPA and "
             "FA4 in reach, its time over the tuned op's.", "",
             "| entry | head_dim | causal | batch x seqlen | heads q/kv | original us | tuned us | speedup | A/A | "
             "speedup - A/A | peer |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        head = f"| {r['entry']} | {s['head_dim']} | {s['causal']} | {s['batch']} x {s['seqlen']} | " \
               f"{s['heads_q']}/{s['heads_kv']} |"
        if r.get("error"):
            lines.append(f"{head} {r['error']} | | | | | |")
            continue
        lines.append(f"{head} {r['heuristic_us']:.1f} | {r['tuned_us']:.1f} | {r['speedup']:.4f}x | "
                     f"{100 * r['aa_spread']:.2f}% | {r['speedup'] - 1 - r['aa_spread']:+.4f} | "
                     f"{r['peer']} {r['vs_peer']:.3f}x |")
    timed = [r for r in rows if not r.get("error")]
    if timed:
        lines += ["", f"Median speedup over the timed rows: {statistics.median(r['speedup'] for r in timed):.4f}x."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", action="append", default=[], metavar="DIR[=LABEL]",
                   help="a tuned store root to sweep (default: the shipped one); repeatable")
    p.add_argument("--seqlens", default="2048,4096,8192")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen per call (default 16384)")
    p.add_argument("--heads", default="32/8", help="query/key heads (default 32/8, Qwen3-8B's)")
    p.add_argument("--kernels", default="d128,d128c,d64c", help=f"comma list of {sorted(NAMES)}")
    p.add_argument("--commit", help="the commit the tree is at (default: git's HEAD; a GPU host's copy of the "
                                     "tree may carry an older .git)")
    report.add_out(p)
    args = p.parse_args(argv)
    unknown = set(args.kernels.split(",")) - set(NAMES)
    if unknown:
        p.error(f"unknown --kernels {sorted(unknown)}; choose from {sorted(NAMES)}")
    wanted = {NAMES[k] for k in args.kernels.split(",")}
    try:
        heads = tuple(int(h) for h in args.heads.split("/"))
        seqlens = [int(s) for s in args.seqlens.split(",")]
    except ValueError:
        p.error("--heads Q/KV and --seqlens N,N,... take positive integers")
    if len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1] or min(seqlens) < 1:
        p.error("--heads Q/KV with Q a multiple of KV, --seqlens N,N,... positive")

    report.require_gpu()
    import torch
    from rosekernels import tuned

    roots = [(Path(e.split("=")[0]), e.split("=", 1)[1] if "=" in e else Path(e).name) for e in args.entries]
    found = [x for root, label in (roots or [(tuned.SHIPPED_ROOT, "shipped")]) for x in entries(root, label, wanted)]
    if not found:
        p.error("no dense attention entry of the selected kernels under the given roots")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = sweep(found, seqlens, args.tokens, heads, sms)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    meta = {**report.environment(), "date": datetime.date.today().isoformat(), "commit": commit,
            "command": "python bench/sip_oplevel_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    report.write(args.out, "sip_oplevel_sweep", {"meta": meta, "rows": rows}, markdown(rows, meta))
    return 0 if any(not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
