"""bench/charts.py draws a PNG from the dict each benchmark writes (synthetic ones here, with random values
and ragged sizes, and the committed ones in bench/results/), and report.write puts the chart beside the
JSON and markdown, in the result's family folder, without ever losing them."""
import json
import math
import random
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))  # the benchmark scripts import report and charts as top-level modules

import charts  # noqa: E402
import report  # noqa: E402
from matplotlib.image import imread  # noqa: E402


def _sample(rng, lo, hi, n):
    return sorted(rng.sample(range(lo, hi), n))


def qk_norm_data(rng):
    rows = []
    for model in ("Model-A", "Model-B"):
        for t in _sample(rng, 1, 200, 3):
            rows.append({"model": model, "tokens": t, "ours_graph_us": rng.uniform(1, 2), "empty_graph_us": 0.6,
                         "copy_graph_us": rng.uniform(1, 1.5), "quack_graph_us": rng.uniform(2, 3),
                         "torch_eager_graph_us": rng.uniform(3, 7)})
        for t in _sample(rng, 1000, 40000, 4):
            copy = t / 200
            rows.append({"model": model, "tokens": t, "copy_us": copy, "ours_us": copy * rng.uniform(1.0, 1.1),
                         "quack_us": copy * rng.uniform(1.0, 3.0), "liger_us": None,
                         "torch_compile_us": copy * rng.uniform(2, 5)})
    rng.shuffle(rows)  # the chart orders by tokens itself
    return {"env": {"gpu": "test GPU"}, "rows": rows}


def rmsnorm_data(rng):
    rows = []
    for hidden in (rng.choice([2048, 4096]), 16384):
        rows.append({"hidden": hidden, "rows": rng.randint(3000, 20000), "residual": rng.random() < 0.5,
                     "copy_us": 60.0, "ours_us": rng.uniform(60, 70), "quack_us": rng.uniform(60, 80)})
        rows.append({"hidden": hidden, "rows": 1, "residual": False, "ours_graph_us": rng.uniform(1, 2),
                     "torch_eager_graph_us": rng.uniform(3, 12)})
    return {"env": {"gpu": "test GPU"}, "rows": rows}


def moe_data(rng):
    rows = []
    for model in ("moe-a", "moe-b"):
        for t in _sample(rng, 1, 300, 3) + _sample(rng, 500, 9000, 3):
            mode = "decode" if t < 300 else "prefill"
            row = {"model": model, "tokens": t, "mode": mode, "combine_mode": mode,
                   "bytes_dispatch": t * 65536, "bytes_combine": t * 36864}
            timing = "graph" if mode == "decode" else "eager"
            for impl, scale in (("rk", 1.0), ("torch", 12.0)):
                for op in ("dispatch", "combine"):
                    row[f"{impl}_{op}_{timing}_us"] = scale * rng.uniform(1, 2) * (5 + t / 60)
            if rng.random() < 0.5:
                row[f"compile_dispatch_{timing}_us"] = rng.uniform(50, 300)
            rows.append(row)
    return {"env": {"gpu": "test GPU"}, "copy_gbps": 4200.0, "rows": rows}


def gemm_data(rng):
    def methods(m, n, k):
        flop = 2 * m * n * k
        out = []
        for name in ("rosekernels", "cublas+leaky_relu", "cublas", "quack"):
            ms = flop / rng.uniform(3e11, 7e11) / 1e3 if m > 128 else rng.uniform(0.028, 0.04)
            out.append({"method": name, "ms": ms, "tflops": flop / ms / 1e9})
        return out + [{"method": "quack+relu (fused)", "error": "TypeError: unsupported"}]

    results = [{"m": m, "n": n, "k": k, "decode": False, "methods": methods(m, n, k)}
               for m, n, k in ((rng.choice([1000, 4096]), 4096, 4096), (8192, 14336, rng.choice([4096, 4104])))]
    for n, k in ((14336, 4096), (4096, 14336)):
        results += [{"m": m, "n": n, "k": k, "decode": True, "methods": methods(m, n, k)} for m in _sample(rng, 1, 129, 3)]
    return {"meta": {"device": "test GPU", "copy_gbs": 4200.0}, "results": results}


def attention_data(rng):
    keys = ("rosekernels", "sdpa_cudnn", "fa4", "sdpa_flash")
    prefill = [{"b": 16384 // s, "s": s, "hq": hq, "hkv": hkv, "d": d, "causal": causal,
                **{f"{m}_TFLOPs": rng.uniform(300, 750) for m in keys}}
               for hq, hkv, d in ((32, 8, 128), (16, 16, 64)) for causal in (False, True) for s in (1024, 4096, 16384)]
    decode = [{"b": b, "s_q": 1, "s_kv": s, "hq": 32, "hkv": 8, "d": 128, **{f"{m}_us": rng.uniform(7, 500) for m in keys}}
              for b in (1, rng.randint(2, 70)) for s in _sample(rng, 1000, 40000, 3)]
    decode.append({"b": 16, "s_q": 4, "s_kv": 8192, "hq": 32, "hkv": 8, "d": 128, "rosekernels_us": 120.0})
    return {"device": "test GPU", "ceilings": {"copy_GBps": 4160.0, "bf16_gemm_8192_TFLOPs": 780.0},
            "prefill": prefill, "decode": decode}


def autotune_data(rng):
    """Rows as bench/autotune.py's _row writes them, one failed shape and one with NaN times."""
    def row(kernel, mode, shape, peers):
        h = rng.uniform(2, 200)
        best = min(peers, key=peers.get) if peers else None
        return {"kernel": kernel, "mode": mode, "shape": shape, "heuristic_us": h, "tuned_us": h / rng.uniform(1.0, 1.2),
                "speedup": 1.1, "aa_spread": 0.004, "winner": None, "outcome": "kept", "searched": 7, "candidates": 30,
                "pruned_by": "model", "statuses": {"ok": 7}, "shares": {"compile": 0.5, "test": 0.2, "time": 0.3},
                "seconds": 40.0, "peers_us": peers, "best_peer": best, "errors": []}

    results = [row("gemm_leakyrelu", "decode", {"m": rng.randint(1, 128), "n": 14336, "k": 4096, "dtype": "bf16",
                                                "bias": "none", "slope": 0.01},
                   {"cublas": rng.uniform(20, 40), "cublas+leaky_relu": rng.uniform(20, 40)}),
               row("qk_norm", "decode", {"tokens": 1, "q_heads": 32, "k_heads": 8, "head_dim": 128}, {}),
               {**row("rmsnorm", "prefill", {"rows": 4096, "hidden": 4096}, {}), "tuned_us": math.nan},
               {"kernel": "attention_decode", "mode": "decode", "shape": {"batch": 16}, "error": "RuntimeError: boom"}]
    return {"meta": {"gpu": "test GPU"}, "results": results}


def sip_tuning_data(rng):
    rows = [{"kernel": k, "mode": "decode", "original_us": (o := rng.uniform(1, 4)), "tuned_us": o / rng.uniform(0.99, 1.05)}
            for k in ("qk_norm", "rmsnorm", "moe_combine")]
    return {"meta": {"gpu": "test GPU"}, "rows": rows + [{"kernel": "moe_dispatch", "mode": "decode"}]}


def e2e_data(rng):
    """Two models, ragged rows: one decode row failed (no speedup), one prefill row slower than stock."""
    results = {}
    for name, layers in (("model-a", 4), ("model-b", 2)):
        prefill = [{"batch": b, "seqlen": s, "speedup": rng.uniform(0.9, 2.0)} for b in (1, 8) for s in (2048, 8192)]
        decode = [{"mode": m, "batch": b, "speedup": rng.uniform(1.0, 9.0)}
                  for b in (1, 16, 64) for m in ("eager", "graph")]
        results[name] = {"layers": layers, "prefill": prefill[:rng.randint(2, 4)], "decode": decode}
    results["model-b"]["decode"][1]["speedup"] = None
    results["model-a"]["prefill"][0]["speedup"] = 0.8
    return {"env": {"gpu": "test GPU"}, "results": results}


def moe_experts_data(rng):
    """Two geometries, decode and prefill rows; some arms missing (not in reach, or failed)."""
    rows = []
    for name in ("geo-a", "geo-b"):
        for t in (1, rng.randint(2, 64), 128, 4096, 16384):
            times = {arm: rng.uniform(10, 40) * (1 + t / 50) for arm in charts.MOE_EXPERTS_ARMS if rng.random() < 0.8}
            times["rosekernels"] = rng.uniform(8, 30) * (1 + t / 50)
            rows.append({"geometry": name, "tokens": t, "mode": "decode" if t <= 128 else "prefill",
                         "weight_bytes": rng.uniform(1e7, 1e9), "flops": 6 * 8 * t * 2048 * 768, "times_us": times,
                         **({"dense_us": rng.uniform(5, 30) * (1 + t / 50)} if t > 128 else {})})
    return {"env": {"gpu": "test GPU"}, "copy_gbps": 4200.0, "rows": rows}


def fp8_data(rng):
    """Decode rows over M and weight shapes (a peer missing on some), prefill rows, KV rows (bench/fp8.py)."""
    methods = ("rosekernels fp8 channel", "rosekernels fp8 block", "torch._scaled_mm rowwise", "rosekernels bf16")
    decode, prefill = [], []
    for n, k in ((4096, 4096), (rng.choice([1024, 12288]), 4096)):
        for m in (1, rng.randint(2, 64), 128):
            times = {name: rng.uniform(5, 40) for name in methods if rng.random() < 0.85 or "rosekernels" in name}
            decode.append({"m": m, "n": n, "k": k, "times_us": times,
                           "summary": {"pct_copy": {name: rng.uniform(40, 95) for name in times}}})
        times = {name: rng.uniform(200, 900) for name in methods}
        prefill.append({"m": 4096, "n": n, "k": k, "times_us": times,
                        "tflops": {name: 2 * 4096 * n * k / t / 1e6 for name, t in times.items()}})
    kv = [{"context": c, "times_us": {"bf16 cache": rng.uniform(40, 80), "e4m3 cache": rng.uniform(25, 50)}}
          for c in (8192, 16384, 32768)]
    return {"env": {"gpu": "test GPU"}, "decode": decode, "prefill": prefill, "kv": kv}


SYNTHETIC = {"qk_norm": qk_norm_data, "rmsnorm": rmsnorm_data, "moe": moe_data, "gemm_leakyrelu": gemm_data,
             "attention": attention_data, "autotune": autotune_data, "sip_tuning": sip_tuning_data, "e2e": e2e_data,
             "moe_experts": moe_experts_data, "fp8": fp8_data}


def assert_real_chart(path: Path):
    """A PNG of a real size with drawing on it: not blank, more than a few colours."""
    assert path.is_file() and path.stat().st_size > 10_000
    img = imread(path)
    assert img.shape[0] >= 200 and img.shape[1] >= 500
    rgb = img[..., :3].reshape(-1, 3)
    assert (rgb.min(axis=1) < 0.9).mean() > 0.02  # more than 2% of the pixels are not (near) white
    assert len({tuple(p) for p in (rgb[::7] * 15).round().astype(int).tolist()}) > 8


def test_every_chart_has_a_synthetic_case():
    assert set(SYNTHETIC) == set(charts.CHARTS)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_each_chart_draws_a_png_from_a_synthetic_result(name, tmp_path):
    data = json.loads(json.dumps(SYNTHETIC[name](random.Random())))  # as report.write hands it over: via JSON
    path = charts.draw(name, data, tmp_path)
    assert path == tmp_path / f"{name}.png"
    assert_real_chart(path)


@pytest.mark.parametrize("name, path", charts.results(RESULTS), ids=lambda x: x if isinstance(x, str) else "")
def test_the_committed_results_draw(name, path, tmp_path):
    assert_real_chart(charts.draw(name, charts.load(path), tmp_path))


def test_the_redraw_finds_every_committed_chart_beside_its_result():
    found = charts.results(RESULTS)
    assert len(found) >= 8 and all(path.parent != RESULTS for _, path in found)  # in family folders
    assert {(name, path.parent) for name, path in found} == {
        (png.stem, png.parent) for png in RESULTS.rglob("*.png") if png.stem in charts.CHARTS}


@pytest.mark.parametrize("name, where", [
    ("qk_norm", "norms"), ("rmsnorm", "norms"), ("gemm_leakyrelu", "gemm"), ("gemm_swiglu", "gemm"), ("fp8", "gemm"),
    ("autotune", "gemm"), ("gemm_swiglu_sweep", "gemm/sweeps"), ("gemm_leakyrelu_decode_wide_2", "gemm/sweeps"),
    ("gemm_leakyrelu_prefill_sweep", "gemm/sweeps"), ("autotune_multicast", "gemm/sweeps"),
    ("attention", "attention"), ("attention_grid", "attention"), ("attention_kvcache", "attention"),
    ("attention_sweep_grid", "attention/sweeps"), ("attention_tile_n", "attention/sweeps"),
    ("autotune_attention", "attention/sweeps"), ("moe", "moe"), ("moe_experts", "moe"),
    ("moe_multigpu_emulated", "moe"), ("sip_tuning", "sip"), ("sip_compute", "sip"), ("sip_engine", "sip"),
    ("sass_latency", "sip"), ("cubin_hashes_h200_cu13", "sip"), ("e2e", "model"), ("e2e_quick", "model"),
    ("sip_tune_model_qwen3_8b_decode", "model"), ("gpu_suite", "suite"),
    ("host_time_a", "."), ("gemmx", ".")])  # no family: a prefix counts only whole, up to a "_"
def test_a_result_name_maps_to_its_family_folder(name, where):
    assert report.folder(name) == Path(where)


def test_every_committed_result_sits_in_the_folder_report_names():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) >= 80
    misplaced = [str(p.relative_to(RESULTS)) for p in files
                 if p.parent == RESULTS or p.parent.relative_to(RESULTS) != report.folder(p.name.split(".")[0])]
    assert not misplaced


def test_every_link_in_a_committed_result_resolves():
    for md in RESULTS.rglob("*.md"):
        for link in re.findall(r"\]\(([^)]+)\)", md.read_text()):
            assert (md.parent / link).is_file(), (md.relative_to(RESULTS), link)


def _line(fig, label):
    return next(line for ax in fig.axes for line in ax.get_lines() if line.get_label() == label)


def test_fp8_draws_one_kv_line_per_lengths_and_query_dtype_over_its_own_cache():
    data = fp8_data(random.Random())
    data["kv"] = [{"context": c, "lengths": lengths, "query": query,
                   "times_us": {f"{query} cache": 2.0 * c, "e4m3 cache": c * (1.0 if lengths == "full" else 1.6)}}
                  for c in (8192, 32768) for lengths in ("full", "ragged") for query in ("bf16", "fp16")]
    data["kv"].pop()  # 32k ragged fp16 not measured: a gap, not another line's value
    fig = charts.CHARTS["fp8"](data)
    assert list(_line(fig, "full lengths, fp16 query").get_ydata()) == pytest.approx([2.0, 2.0])
    ragged = _line(fig, "ragged lengths, fp16 query")
    assert list(ragged.get_xdata()) == [8192] and list(ragged.get_ydata()) == pytest.approx([1.25])


def test_qk_norm_plots_our_share_of_the_copy_ceiling_in_token_order():
    data = qk_norm_data(random.Random())
    line = _line(charts.qk_norm(data), charts.OURS)  # the first: prefill of the model met first
    model = data["rows"][0]["model"]
    pre = sorted((r for r in data["rows"] if r["model"] == model and "ours_us" in r), key=lambda r: r["tokens"])
    assert list(line.get_xdata()) == [r["tokens"] for r in pre]
    assert line.get_ydata() == pytest.approx([100 * r["copy_us"] / r["ours_us"] for r in pre])


def test_moe_takes_graph_times_where_measured_else_eager():
    data = moe_data(random.Random())
    row = next(r for r in data["rows"] if r["model"] == "moe-a" and r["mode"] == "prefill")
    row["rk_dispatch_graph_us"] = row["rk_dispatch_eager_us"] / 2  # a graph time wins over the eager one
    line = _line(charts.moe(data), f"{charts.OURS} (moe-a)")
    pre = sorted((r for r in data["rows"] if r["model"] == "moe-a" and r["mode"] == "prefill"), key=lambda r: r["tokens"])
    want = [100 * r["bytes_dispatch"] / r.get("rk_dispatch_graph_us", r["rk_dispatch_eager_us"]) / 1e3 / 4200.0
            for r in pre]
    assert line.get_ydata() == pytest.approx(want)


def test_moe_experts_plots_our_decode_times_in_token_order_and_prefill_tflops():
    data = moe_experts_data(random.Random(4))
    fig = charts.moe_experts(data)
    line = _line(fig, charts.OURS)  # the first: decode of the first geometry
    dec = sorted((r for r in data["rows"] if r["geometry"] == "geo-a" and r["mode"] == "decode"),
                 key=lambda r: r["tokens"])
    assert list(line.get_xdata()) == [r["tokens"] for r in dec]
    assert list(line.get_ydata()) == pytest.approx([r["times_us"]["rosekernels"] for r in dec])
    bars = next(c for c in fig.axes[2].containers if c.get_label() == charts.OURS)  # geo-a's prefill panel
    pre = sorted((r for r in data["rows"] if r["geometry"] == "geo-a" and r["mode"] == "prefill"),
                 key=lambda r: r["tokens"])
    assert [b.get_height() for b in bars] == pytest.approx([r["flops"] / r["times_us"]["rosekernels"] / 1e6
                                                            for r in pre])


def test_gemm_bars_are_speedups_over_cublas():
    data = gemm_data(random.Random())
    ax = charts.gemm_leakyrelu(data).axes[0]
    ours = next(c for c in ax.containers if c.get_label() == charts.OURS)
    pre = [r for r in data["results"] if not r["decode"]]
    times = [{m["method"]: m["ms"] for m in r["methods"] if "ms" in m} for r in pre]
    assert [bar.get_y() + bar.get_height() for bar in ours] == pytest.approx([t["cublas"] / t["rosekernels"] for t in times])
    assert charts.OURS in {c.get_label() for c in ax.containers} and "cublas" not in {c.get_label() for c in ax.containers}


def test_autotune_skips_failed_rows_and_shows_tuned_time_relative_to_the_heuristic():
    data = autotune_data(random.Random())
    ax = charts.autotune(data).axes[0]
    good = data["results"][:2]  # the NaN and the failed shape are left out
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "gemm_leakyrelu decode " + ",".join(f"{k}={good[0]['shape'][k]}" for k in ("m", "n", "k")),
        "qk_norm decode tokens=1,q_heads=32,k_heads=8,head_dim=128"]
    tuned = next(c for c in ax.containers if c.get_label() == "tuned")
    assert [bar.get_width() for bar in tuned] == pytest.approx([r["tuned_us"] / r["heuristic_us"] for r in good])


def test_e2e_bars_are_speedups_over_stock_from_one():
    data = e2e_data(random.Random(3))
    ax = charts.e2e(data).axes[0]
    r = data["results"]["model-a"]
    want = [p["speedup"] for p in r["prefill"]] + [d["speedup"] for d in r["decode"]]
    bars = ax.patches
    assert len(bars) == len(want)
    for bar, v in zip(bars, want):
        assert bar.get_y() == 1.0 and bar.get_y() + bar.get_height() == pytest.approx(v)


def test_bad_data_raises_and_writes_nothing(tmp_path):
    with pytest.raises(KeyError):
        charts.draw("qk_norm", {"env": {}, "rows": [{"tokens": 1}]}, tmp_path)
    with pytest.raises(ValueError, match="no row"):
        charts.draw("sip_tuning", {"meta": {}, "rows": [{"kernel": "x", "mode": "decode"}]}, tmp_path)
    assert charts.draw("no_such_benchmark", {}, tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_report_write_adds_the_chart_after_the_json_and_markdown(tmp_path, capsys):
    data = rmsnorm_data(random.Random())
    where = tmp_path / "norms"
    assert report.write(tmp_path, "rmsnorm", data, "# rmsnorm") == where
    assert json.loads((where / "rmsnorm.json").read_text()) == data
    assert (where / "rmsnorm.md").read_text() == "# rmsnorm\n\n![rmsnorm](rmsnorm.png)\n"
    assert_real_chart(where / "rmsnorm.png")
    assert "![rmsnorm](rmsnorm.png)" in capsys.readouterr().out
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "norms", "norms/rmsnorm.json", "norms/rmsnorm.md", "norms/rmsnorm.png"]


def test_a_chart_that_fails_loses_neither_json_nor_markdown(tmp_path, capsys):
    report.write(tmp_path, "moe", {"rows": "not rows"}, "# moe\n")
    assert json.loads((tmp_path / "moe" / "moe.json").read_text()) == {"rows": "not rows"}
    assert (tmp_path / "moe" / "moe.md").read_text() == "# moe\n"
    assert not (tmp_path / "moe" / "moe.png").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe: no chart (")


def test_a_result_without_a_chart_gets_no_png_and_no_link(tmp_path):
    report.write(tmp_path, "host_time_x", {"a": 1}, "# host time")  # no family: the top of --out
    report.write(tmp_path, "gemm_swiglu_sweep", {"a": 1}, "# sweep")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")) == [
        "gemm/sweeps/gemm_swiglu_sweep.json", "gemm/sweeps/gemm_swiglu_sweep.md", "host_time_x.json", "host_time_x.md"]
    assert (tmp_path / "host_time_x.md").read_text() == "# host time\n"


def test_redraw_command(tmp_path, capsys):
    with pytest.raises(SystemExit):
        charts.main([str(tmp_path / "missing")])
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        charts.main([str(tmp_path)])
    assert "holds none of" in capsys.readouterr().err
    (tmp_path / "norms").mkdir()  # a family folder: the chart goes beside its result
    (tmp_path / "norms" / "rmsnorm.json").write_text(json.dumps(rmsnorm_data(random.Random())))
    (tmp_path / "moe.json").write_text(json.dumps({"rows": []}))  # bad: no copy_gbps
    assert charts.main([str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert out.out.split() == [str(tmp_path / "norms" / "rmsnorm.png")] and "moe.json: no chart (KeyError" in out.err
    assert_real_chart(tmp_path / "norms" / "rmsnorm.png")
    assert not (tmp_path / "moe.png").exists() and not (tmp_path / "rmsnorm.png").exists()
