"""Report writing shared by the benchmark scripts: the run's environment, number formatting, peers that
may be missing, and the JSON + markdown files under bench/results/<family>/ (`folder`)."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from rosekernels import device

RESULTS = Path(__file__).resolve().parent / "results"  # the committed results: written only when asked
LOCAL = Path(__file__).resolve().parent / "out"  # where a run writes by default (ignored by git)

# A result's family: the longest of these prefixes that its name is or starts with followed by "_".
FAMILIES = {"qk_norm": "norms", "rmsnorm": "norms", "gemm": "gemm", "fp8": "gemm", "autotune": "gemm",
            "autotune_attention": "attention", "attention": "attention", "moe": "moe", "sip": "sip",
            "sass_latency": "sip", "cubin_hashes": "sip", "e2e": "model", "sip_tune_model": "model",
            "gpu_suite": "suite"}
# Names of config sweeps, cost-model fits, tuning studies and A/B runs of a branch against main, kept apart from
# the headline tables.
SWEEPS = ("_sweep", "_decode_", "_prefill_", "_broad", "_fitted", "_clusters", "_refit", "_tile_n", "autotune_", "_ab_")


def folder(name: str) -> Path:
    """Where result `name` lives under a results folder: <family>, or <family>/sweeps for a sweep or a fit
    (`gemm_leakyrelu` -> gemm, `gemm_leakyrelu_decode_broad` -> gemm/sweeps); a name of no family stays at
    the top (tests/test_bench_charts.py fails on such a file in bench/results until FAMILIES names it)."""
    prefix = max((p for p in FAMILIES if name == p or name.startswith(p + "_")), key=len, default=None)
    if prefix is None:
        return Path()
    family = Path(FAMILIES[prefix])
    return family / "sweeps" if any(mark in name for mark in SWEEPS) else family


def add_out(parser: Any) -> None:
    """The --out option of every benchmark: a local folder by default, so that a run never overwrites the
    committed results unless asked (`--out bench/results`)."""
    parser.add_argument("--out", default=str(LOCAL),
                        help=f"folder for the JSON and markdown results, each in its family's folder under it "
                        f"(default {LOCAL}; the committed ones: {RESULTS})")


def require_gpu() -> None:
    """End the run with one line, not a traceback, and rosekernels.device.NO_GPU_EXIT where there is no
    sm_90 GPU to measure on."""
    device.require_gpu(Path(sys.argv[0]).name, "to measure")


def environment(peers: tuple[str, ...] = ()) -> dict[str, Any]:
    """GPU, software versions and each named peer package's version (or "unavailable")."""
    from rosekernels import jit

    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                            "python": platform.python_version(), "toolchain": jit.TOOLCHAIN,
                            "l2_bytes": getattr(props, "L2_cache_size", None)}
    for name in peers:
        try:
            info[name] = getattr(__import__(name), "__version__", "present")
        except Exception:  # noqa: BLE001 - a missing or broken peer is recorded, not fatal
            info[name] = "unavailable"
    return info


def agrees(name: str, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], bar: float, errors: list[str]) -> bool:
    """Whether each (got, float64 ref) of `pairs` is within `bar`, as max |got - ref| / (1 + |ref|) (got taken
    in ref's shape); off it, `errors` gets the arm's error and that it is not timed."""
    err = max(((got.reshape(ref.shape).double() - ref).abs() / (1 + ref.abs())).max().item() for got, ref in pairs)
    if err <= bar:
        return True
    errors.append(f"{name}: error {err:.3g} against the float64 reference; not timed")
    return False


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(peer: float | None, ours: float | None) -> float | None:
    return None if peer is None or ours is None else peer / ours


def try_peer(name: str, factory: Callable[[], Any], log: list[str]) -> Any:
    """factory() -> a callable peer, or None with the reason logged ("unavailable")."""
    try:
        return factory()
    except Exception as e:  # noqa: BLE001 - a missing or broken peer is recorded, not fatal
        log.append(f"{name}: unavailable ({type(e).__name__}: {e})")
        return None


def measure(name: str, fn: Callable[[], Any], errors: list[str]) -> Any:
    """fn(), or None with the error recorded: one failing method does not end the run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        errors.append(f"{name}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None


def model_sweep(argv: list[str] | None, doc: str, stem: str, models: Iterable[str], tokens: Iterable[int],
                measure_one: Callable[[str, int, int], dict], describe: Callable[[dict], str],
                markdown: Callable[[dict, list[dict], list[str]], str], peers: tuple[str, ...] = ()) -> int:
    """The command line of a bench that times each of `models` at each token count: --out, --models, --tokens,
    --rounds (15); `measure_one(model, tokens, rounds)` gives a row (a failure is recorded, the rest go on),
    `describe(row)` its progress line; writes `stem`.json and .md (`markdown(env, rows, errors)`; env names
    the versions of the `peers` packages)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_out(p)
    p.add_argument("--models", default=",".join(models))
    p.add_argument("--tokens", default=",".join(map(str, tokens)))
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    chosen = known_names(p, args.models, models, "models")
    counts = [int(t) for t in args.tokens.split(",")]
    cases = [(f"{m} T={t}", lambda m=m, t=t: measure_one(m, t, args.rounds)) for m in chosen for t in counts]
    return run_cases(args.out, stem, cases, describe, markdown, peers)


def known_names(parser: argparse.ArgumentParser, text: str, known: Iterable[str], what: str) -> list[str]:
    """The comma-separated names of a command-line value, each one of `known`; else the parser's error (exit 2)."""
    names, known = text.split(","), list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def run_cases(out: str | Path, stem: str, cases: Iterable[tuple[str, Callable[[], dict]]],
              describe: Callable[[dict], str], markdown: Callable[[dict, list[dict], list[str]], str],
              peers: tuple[str, ...] = ()) -> int:
    """A bench's run on the GPU: each (label, fn) of `cases` gives a row (a failure is recorded under its label,
    the rest go on), printed as `label: describe(row)`; then `stem`.json ({env, rows, errors, seconds}; env:
    environment(peers)) and .md (`markdown(env, rows, errors)`) under `out`. Returns 0."""
    require_gpu()
    t0, errors, rows = time.time(), [], []
    for label, fn in cases:
        row = measure(label, fn, errors)
        if row:
            rows.append(row)
            print(f"{label}: {describe(row)}", flush=True)
    env = environment(peers)
    write(out, stem, {"env": env, "rows": rows, "errors": errors, "seconds": time.time() - t0},
          markdown(env, rows, errors))
    return 0


def write(out: str | Path, stem: str, data: Any, markdown: str) -> Path:
    """<dir>/<stem>.json and <dir>/<stem>.md, <dir> = <out>/folder(stem), then <dir>/<stem>.png where
    bench/charts.py has a chart for `stem` (linked from the end of the markdown), and the markdown on
    stdout; returns <dir>. A chart that cannot be drawn costs one line on stderr, never the JSON or the
    markdown, which are written first."""
    out = Path(out) / folder(stem)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, default=str)
    (out / f"{stem}.json").write_text(text)
    markdown = markdown if markdown.endswith("\n") else markdown + "\n"
    (out / f"{stem}.md").write_text(markdown)
    try:
        import charts  # here, not above: matplotlib is optional (pip install 'rosekernels[bench]')

        # The chart reads what was written, as `python bench/charts.py` does when it redraws.
        png = charts.draw(stem, json.loads(text), out)
    except Exception as e:  # noqa: BLE001 - a chart is a view of the results, never worth losing them
        png = None
        print(f"{stem}: no chart ({type(e).__name__}: {e})", file=sys.stderr)
    if png is not None:
        markdown += f"\n![{stem}]({png.name})\n"
        (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    return out


def recommend_table(sweep_rows: list[dict]) -> list[tuple]:
    """rosekernels.modes.PREFILL_TABLE rows for a memory-bound op from its block-shape sweep: each
    sweep row has "warps_needed", "times" {label: us} and "modes" {label: (warps, rows per thread,
    cache hint)}; the best prefill shape at each measured size, equal neighbours merged, the last
    row widened to catch everything."""
    from rosekernels import modes

    best: dict[int, list] = {}
    for s in sweep_rows:
        pre = {k: v for k, v in s["times"].items() if k != "decode" and v is not None}
        if pre and s["warps_needed"] > modes.sm_count():
            best.setdefault(s["warps_needed"], []).append((pre, s["modes"]))
    table: list[tuple] = []
    for wn in sorted(best):
        # several shapes can need the same warps: take the block size best on their total time
        labels = set.intersection(*(set(p) for p, _ in best[wn]))
        label = min(labels, key=lambda k: sum(p[k] for p, _ in best[wn]))
        entry = tuple(best[wn][0][1][label])
        if table and table[-1][1:] == entry:
            table[-1] = (wn, *entry)
        else:
            table.append((wn, *entry))
    if table:
        table[-1] = (1 << 62, *table[-1][1:])
    return table
