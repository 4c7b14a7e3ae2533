"""Fit the decode GEMM cost model (rosekernels.kernels.gemm_leakyrelu_plan.decode_cost) to a sweep.

    cd bench/results/gemm/sweeps && python ../../../../tools/fit_gemm_decode.py gemm_leakyrelu_decode_broad.json.gz \
        gemm_leakyrelu_decode_fitted.json.gz gemm_swiglu_sweep.json.gz gemm_leakyrelu_decode_wide.json.gz \
        gemm_leakyrelu_decode_wide_2.json.gz gemm_leakyrelu_decode_clusters_m16-64.json.gz \
        gemm_leakyrelu_decode_clusters_m96-128.json.gz gemm_leakyrelu_decode_clusters_plain.json.gz
    python tools/fit_gemm_decode.py --current SWEEP...   # the plan module's picks as they stand
                                                         # (held out: gemm_leakyrelu_decode_clusters_unseen.json.gz)

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

from rosekernels.kernels import gemm_leakyrelu_plan as plan

SMS = 132
DRAM_BW = 3.9e6  # bytes per us
# (name, low, high) of each fitted constant, in decode_cost's units (bytes, us, multiply-adds).
BOUNDS = [("_SM_BW", 3e4, 9e4), ("_MMA_RATE", 2.0e6, 3.6e6), ("_WAVE_US", 0.2, 6.0), ("_SPLIT_US", 0.0, 4.0),
          ("_SPLIT_US swapped", 0.0, 4.0), ("_PARTIALS_BW", 1e4, 2e5), ("_L2_BW", 4e6, 3e7)]
EFFICIENCY = (0.3, 2.5)
MULTICAST = (0.5, 2.0)  # bounds of a cluster shape's factor on its tile family's efficiency
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


def config_of(row: dict):
    """The plan module's GemmConfig of a sweep row (sweeps before clusters have no cluster fields)."""
    return plan.GemmConfig(
        tile_m=row["tile_m"], tile_n=row["tile_n"], a_rows=None if row["swap_ab"] else row["a_rows"],
        swap_ab=row["swap_ab"], cluster_m=row.get("cluster_m", 1), cluster_n=row.get("cluster_n", 1), split_k=True,
        splits=row["splits"], gated=row["gated"], activation="silu" if row["gated"] else "leaky_relu")


def multicast_of(row: dict):
    """The cluster factor's key of a row (decode_cost's _MULTICAST), None without a cluster."""
    shape = (row.get("cluster_m", 1), row.get("cluster_n", 1))
    return None if shape == (1, 1) else ("swapped" if row["swap_ab"] else "plain", *shape)


def features(m: int, n: int, k: int, row: dict) -> list[float]:
    """What decode_cost reads of one config: waves, weight bytes of the busiest CTA, MMA work,
    split or not, partials bytes the last split reads."""
    k_tiles, splits = math.ceil(k / 64), row["splits"]
    config = config_of(row)
    tiles = plan.output_tiles(config, m, n)
    weight_rows = row["tile_m"] if row["swap_ab"] else row["tile_n"]
    partial_rows = row["tile_m"] if row["swap_ab"] else min(m, row["tile_m"])
    waves = math.ceil(tiles * splits / plan.resident_ctas(config, SMS))
    unit_k = math.ceil(k_tiles / splits) * 64
    return [waves, waves * weight_rows * unit_k * 2, n * k * 2, waves * row["tile_m"] * row["tile_n"] * unit_k,
            float(splits > 1), partial_rows * row["tile_n"] * 4 * splits if splits > 1 else 0.0, float(row["swap_ab"]),
            plan.l2_bytes(config, m, n, k)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="JSON written by bench/gemm_leakyrelu.py --sweep (.gz: compressed)")
    p.add_argument("--restarts", type=int, default=4, help="fits from the current constants and perturbations")
    p.add_argument("--current", action="store_true",
                   help="fit nothing: print the picks of the plan module's decode_cost as it stands")
    args = p.parse_args()
    shapes, rows, runs = [], [], []
    for i, path in enumerate(args.sweeps):
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
        for result in data["results"]:
            for row in result.get("sweep", []):
                if "ms" not in row or "swap_ab" not in row:
                    continue
                row = dict(row, gated=result.get("gated", False))
                if not plan.two_m_tiles(config_of(row), result["m"]):  # the tuner's only: not fitted
                    shapes.append((result["m"], result["n"], result["k"]))
                    rows.append(row)
                    runs.append(i)
    families = sorted({f for r in rows for f, _ in families_of(r)}, key=str)
    fam = np.zeros((len(rows), len(families)))
    for i, r in enumerate(rows):
        for f, weight in families_of(r):
            fam[i, families.index(f)] = weight
    multicasts = sorted({multicast_of(r) for r in rows} - {None})
    mc = np.zeros((len(rows), len(multicasts)))
    for i, r in enumerate(rows):
        if multicast_of(r) is not None:
            mc[i, multicasts.index(multicast_of(r))] = 1.0
    x = np.array([features(*s, r) for s, r in zip(shapes, rows)])
    logy = np.log([r["ms"] * 1e3 for r in rows])
    by_shape = collections.defaultdict(list)
    for i, (s, run) in enumerate(zip(shapes, runs)):
        by_shape[(*s, run)].append(i)
    groups = [np.array(ix) for ix in by_shape.values()]

    def unpack(p):
        vals = [lo + (hi - lo) / (1 + np.exp(-v)) for v, (_, lo, hi) in zip(p, BOUNDS)]
        lo, hi = EFFICIENCY
        eff = lo + (hi - lo) / (1 + np.exp(-p[len(BOUNDS):len(BOUNDS) + len(families)]))
        lo, hi = MULTICAST
        return vals, eff, lo + (hi - lo) / (1 + np.exp(-p[len(BOUNDS) + len(families):]))

    def predict(p):
        (sm_bw, mma, wave, split, split_swapped, partials_bw, l2_bw), eff, factor = unpack(p)
        stream = np.maximum(x[:, 2] / DRAM_BW, x[:, 1] / (sm_bw * (fam @ eff) * (1 + mc @ (factor - 1))))
        stream = np.maximum(stream, x[:, 7] / l2_bw)
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
        pred = np.array([plan.decode_cost(config_of(r), *s, SMS) for s, r in zip(shapes, rows)])
        report_picks(pred, logy, by_shape)
        return
    # Start from the plan module's constants (a cluster shape it has no factor for at 1), then from
    # random perturbations of them.

    def logit(v, lo, hi):
        f = min(max((v - lo) / (hi - lo), 1e-3), 1 - 1e-3)
        return math.log(f / (1 - f))
    names = {"_SPLIT_US swapped": "_SPLIT_SWAPPED_US"}
    start = [logit(getattr(plan, names.get(name, name)), lo, hi) for name, lo, hi in BOUNDS]
    start += [logit(plan._EFFICIENCY.get(f, 1.0), *EFFICIENCY) for f in families]
    start += [logit(plan._MULTICAST.get(f, 1.0), *MULTICAST) for f in multicasts]
    rng = np.random.default_rng(2)
    starts = [np.array(start)] + [np.array(start) + rng.normal(0, 0.5, len(start)) for _ in range(args.restarts - 1)]
    best = min((minimize(loss, x0, method="Powell", options=dict(maxiter=30000, xtol=1e-4, ftol=1e-7))
                for x0 in starts), key=lambda r: r.fun)
    vals, eff, factor = unpack(best.x)
    for (name, _, _), v in zip(BOUNDS, vals):
        print(f"{name} = {v:.4g}")
    print("_EFFICIENCY = {" + ", ".join(f"{f}: {e:.2f}" for f, e in zip(families, eff)) + "}")
    print("_MULTICAST = {" + ", ".join(f"{f}: {e:.2f}" for f, e in zip(multicasts, factor)) + "}")
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
