"""Fit the decode GEMM cost model (rosekernels.kernels.gemm_leakyrelu_plan.decode_cost) to a sweep.

    cd bench/results && python ../../tools/fit_gemm_decode.py gemm_leakyrelu_decode_broad.json.gz \
        gemm_leakyrelu_decode_fitted.json.gz gemm_swiglu_sweep.json.gz gemm_leakyrelu_decode_wide.json.gz \
        gemm_leakyrelu_decode_wide_2.json.gz
    python tools/fit_gemm_decode.py --current SWEEP...   # the plan module's picks as they stand
                                                         # (also on gemm_leakyrelu_decode_m64x2.json.gz)

A sweep is what `python bench/gemm_leakyrelu.py --sweep --sweep-splits 1,2,3,4,6,8 --shapes ...` or
`python bench/gemm_swiglu.py --sweep` (gated GEMMs) writes: every decode config of each shape timed
in a CUDA graph (each file's shapes are fitted as timed there: ratios within one run). Plain tiles of widths between the anchor widths (ANCHORS) take
the linear interpolation of the anchors' efficiencies, as decode_cost does. The model's parameters are found by
minimising the time lost by its pick on each shape (a soft-min over the shape's configs, so the loss
is smooth), plus a small weight on the log error of every prediction; each parameter is kept within
physical bounds (per-SM bandwidth 30-90 GB/s, MMA rate 2.0-3.6 multiply-adds per ns per SM, ...).
The whole GPU's bandwidth is not fitted: 3.9 TB/s, what the sweep's best shapes stream. Prints the
constants to paste into the plan module and the pick's loss per shape. Needs numpy and scipy.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import math

import numpy as np
from scipy.optimize import minimize

SMS = 132
DRAM_BW = 3.9e6  # bytes per us
# (name, low, high) of each fitted constant, in decode_cost's units (bytes, us, multiply-adds).
BOUNDS = [("_SM_BW", 3e4, 9e4), ("_MMA_RATE", 2.0e6, 3.6e6), ("_WAVE_US", 0.2, 6.0), ("_SPLIT_US", 0.0, 4.0),
          ("_SPLIT_US swapped", 0.0, 4.0), ("_PARTIALS_BW", 1e4, 2e5)]
EFFICIENCY = (0.3, 1.6)
ANCHORS = {64: (64, 128, 256), 128: (32, 64, 128, 256)}  # plain tile widths with an efficiency of their own


def families_of(row: dict) -> list[tuple[tuple, float]]:
    """(efficiency family, weight) pairs whose weighted sum is the config's efficiency. Families are
    keyed as the plan module's _EFFICIENCY: (kind, tile_m, width of plain tiles), kind "swapped",
    "plain" or "gated" (plain tiles of a gated GEMM: slower than plain ones of the same width in
    every H200 sweep, 0.75x at 64 x 256)."""
    if row["swap_ab"]:
        return [(("swapped", row["tile_m"], None), 1.0)]
    kind = "gated" if row["gated"] else "plain"
    widths = ANCHORS[row["tile_m"]]
    w = min(max(row["tile_n"], widths[0]), widths[-1])
    if w in widths:
        return [((kind, row["tile_m"], w), 1.0)]
    w0, w1 = next((a, b) for a, b in zip(widths, widths[1:]) if a < w < b)
    return [((kind, row["tile_m"], w0), (w1 - w) / (w1 - w0)), ((kind, row["tile_m"], w1), (w - w0) / (w1 - w0))]


def features(m: int, n: int, k: int, row: dict) -> list[float]:
    """What decode_cost reads of one config: waves, weight bytes of the busiest CTA, MMA work,
    split or not, partials bytes the last split reads."""
    k_tiles, splits = math.ceil(k / 64), row["splits"]
    if row["swap_ab"]:
        weight_rows, tiles = row["tile_m"], math.ceil(n / row["tile_m"]) * math.ceil(m / row["tile_n"])
        partial_rows = row["tile_m"]
    else:
        weight_rows, tiles = row["tile_n"], math.ceil(n / row["tile_n"]) * math.ceil(m / row["tile_m"])
        partial_rows = min(m, row["tile_m"])
    waves = math.ceil(tiles * splits / SMS)
    unit_k = math.ceil(k_tiles / splits) * 64
    return [waves, waves * weight_rows * unit_k * 2, n * k * 2, waves * row["tile_m"] * row["tile_n"] * unit_k,
            float(splits > 1), partial_rows * row["tile_n"] * 4 * splits if splits > 1 else 0.0, float(row["swap_ab"])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="JSON written by bench/gemm_leakyrelu.py --sweep (.gz: compressed)")
    p.add_argument("--restarts", type=int, default=10)
    p.add_argument("--current", action="store_true",
                   help="fit nothing: print the picks of the plan module's decode_cost as it stands")
    args = p.parse_args()
    shapes, rows, runs = [], [], []
    for i, path in enumerate(args.sweeps):
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
        for result in data["results"]:
            for row in result.get("sweep", []):
                # Two M tiles (64-row plain, 64-token swapped past 64 tokens: the plan module's
                # TWO_TOKEN_TILES): timed in one sweep, not among the heuristic's decode_configs.
                two_tiles = row.get("tile_n" if row.get("swap_ab") else "tile_m") == 64 and result["m"] > 64
                if "ms" in row and "swap_ab" in row and not two_tiles:
                    shapes.append((result["m"], result["n"], result["k"]))
                    rows.append(dict(row, gated=result.get("gated", False)))
                    runs.append(i)
    families = sorted({f for r in rows for f, _ in families_of(r)}, key=str)
    fam = np.zeros((len(rows), len(families)))
    for i, r in enumerate(rows):
        for f, weight in families_of(r):
            fam[i, families.index(f)] = weight
    x = np.array([features(*s, r) for s, r in zip(shapes, rows)])
    logy = np.log([r["ms"] * 1e3 for r in rows])
    by_shape = collections.defaultdict(list)
    for i, (s, run) in enumerate(zip(shapes, runs)):
        by_shape[(*s, run)].append(i)
    groups = [np.array(ix) for ix in by_shape.values()]

    def unpack(p):
        vals = [lo + (hi - lo) / (1 + np.exp(-v)) for v, (_, lo, hi) in zip(p, BOUNDS)]
        lo, hi = EFFICIENCY
        return vals, lo + (hi - lo) / (1 + np.exp(-p[len(BOUNDS):]))

    def predict(p):
        (sm_bw, mma, wave, split, split_swapped, partials_bw), eff = unpack(p)
        stream = np.maximum(x[:, 2] / DRAM_BW, x[:, 1] / (sm_bw * (fam @ eff)))
        return (np.maximum(stream, x[:, 3] / mma) + x[:, 0] * wave
                + x[:, 4] * np.where(x[:, 6] > 0, split_swapped, split) + x[:, 5] / partials_bw)

    def loss(p, tau=0.02):
        lp = np.log(predict(p))
        lost = 0.0
        for g in groups:
            w = np.exp(-(lp[g] - lp[g].min()) / tau)
            lost += np.dot(w / w.sum(), logy[g] - logy[g].min())
        return lost / len(groups) + 0.05 * np.mean((lp - logy) ** 2)

    if args.current:
        from rosekernels.kernels import gemm_leakyrelu_plan as plan
        pred = np.array([plan.decode_cost(plan.GemmConfig(
            tile_m=r["tile_m"], tile_n=r["tile_n"], a_rows=None if r["swap_ab"] else r["a_rows"], swap_ab=r["swap_ab"],
            cluster_m=1, split_k=True, splits=r["splits"], gated=r["gated"], activation="silu" if r["gated"] else
            "leaky_relu"), *s, SMS) for s, r in zip(shapes, rows)])
        report_picks(pred, logy, by_shape)
        return
    rng = np.random.default_rng(2)
    best = min((minimize(loss, rng.normal(0, 1, len(BOUNDS) + len(families)), method="Powell",
                         options=dict(maxiter=30000, xtol=1e-4, ftol=1e-7)) for _ in range(args.restarts)),
               key=lambda r: r.fun)
    vals, eff = unpack(best.x)
    for (name, _, _), v in zip(BOUNDS, vals):
        print(f"{name} = {v:.4g}")
    print("_EFFICIENCY = {" + ", ".join(f"{f}: {e:.2f}" for f, e in zip(families, eff)) + "}")
    report_picks(predict(best.x), logy, by_shape)


def report_picks(pred, logy, by_shape) -> None:
    """Per shape (and sweep file), the measured time of the config of least predicted time against
    the fastest measured; then their mean and worst ratio."""
    lost = []
    for s, g in by_shape.items():
        pick = g[int(np.argmin(pred[g]))]
        lost.append(math.exp(logy[pick] - logy[g].min()))
        print(f"{s[0]}x{s[1]}x{s[2]} (file {s[3] + 1}): pick {math.exp(logy[pick]):.1f} us, "
              f"best {math.exp(logy[g].min()):.1f} us, "
              f"{lost[-1]:.3f}")
    print(f"pick / best: mean {np.mean(lost):.4f}, worst {max(lost):.3f} over {len(lost)} shapes")


if __name__ == "__main__":
    main()
