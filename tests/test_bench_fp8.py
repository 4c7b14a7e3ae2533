"""bench/fp8.py's report on the CPU: the model shapes it times, the ratios it derives, the issue's targets
(pass, fail, not measured) and the markdown; its argument errors. The timing itself needs the GPU."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fp8 as bench  # noqa: E402


def test_the_shapes_are_the_issues_models():
    assert set(bench.MODELS) == {"llama-3-8b", "qwen3-8b", "qwen2.5-7b"} and bench.DECODE_M == (1, 8, 16, 32, 64, 128)
    roles = {role: (n, k, gated) for role, n, k, gated in bench.weights("qwen2.5-7b")}
    assert roles == {"q": (3584, 3584, False), "k/v": (512, 3584, False), "o": (3584, 3584, False),
                     "gate/up": (37888, 3584, True), "down": (3584, 18944, False)}


def _decode_row(m, n, k, ours, bf16, scaled):
    times = {"rosekernels fp8 tensor": ours, "rosekernels fp8 channel": ours, "rosekernels fp8 block": ours,
             "torch._scaled_mm per-tensor": scaled, "torch._scaled_mm rowwise": scaled, "rosekernels bf16": bf16}
    return {"model": "m", "role": "r", "m": m, "n": n, "k": k, "weight_bytes": n * k, "times_us": times,
            "error_ratio": {"tensor": 1.1, "channel": 1.2, "block": 1.3}}


def test_summary_and_verdicts():
    copy_gbps = 4000.0
    row = _decode_row(16, 4096, 4096, ours=5.0, bf16=10.0, scaled=6.0)
    s = bench.decode_summary(row, copy_gbps)
    assert s["vs_bf16"]["channel"] == pytest.approx(2.0) and s["vs_scaled_mm"]["tensor"] == pytest.approx(1.2)
    # 16 MiB of e4m3 weights in 5 us: 3355 GB/s, 83.9% of 4000
    assert s["pct_copy"]["rosekernels fp8 channel"] == pytest.approx(100 * 4096 * 4096 / 5e3 / copy_gbps)
    assert "rosekernels bf16" not in s["pct_copy"]
    slow = _decode_row(1, 1024, 4096, ours=9.0, bf16=10.0, scaled=6.0)  # small: not under the copy bar
    for r in (row, slow):
        r["summary"] = bench.decode_summary(r, copy_gbps)
    data = {"decode": [row, slow], "prefill": [], "quantize": [{"pct_copy": 95.0}, {"pct_copy": 92.0}],
            "kv": [{"context": 4096, "times_us": {"bf16 cache": 9.0, "e4m3 cache": 8.0}},
                   {"context": 8192, "times_us": {"bf16 cache": 20.0, "e4m3 cache": 11.0}},
                   {"context": 8192, "lengths": "ragged", "query": "bf16",
                    "times_us": {"bf16 cache": 21.0, "e4m3 cache": 12.6}},
                   # the issue's bar is against the bf16 cache: an fp16 query's row is reported, not judged
                   {"context": 8192, "lengths": "full", "query": "fp16",
                    "times_us": {"fp16 cache": 20.0, "e4m3 cache": 19.0}}],
            "e2e": {"speedup": 1.5, "min_cos": 0.995}}
    by = {x["target"]: x for x in bench.verdicts(data)}
    assert len(by) == 10
    decode_bf16 = next(x for t, x in by.items() if "our bf16" in t and t.startswith("decode"))
    assert decode_bf16["worst"] == pytest.approx(10 / 9) and decode_bf16["passes"] is False
    copy = next(x for t, x in by.items() if "of copy for N*K" in t)
    assert copy["worst"] == pytest.approx(s["pct_copy"]["rosekernels fp8 channel"]) and copy["passes"] is True
    assert next(x for t, x in by.items() if t.startswith("prefill: fp8 >= 1.5"))["passes"] is None  # not measured
    assert next(x for t, x in by.items() if t.startswith("error"))["worst"] == pytest.approx(1.3)
    kv = next(x for t, x in by.items() if t.startswith("FP8 KV"))
    assert kv["worst"] == pytest.approx(21 / 12.6) and kv["passes"] is True  # the 4k context is not under the bar
    md = bench.markdown({"env": {"gpu": "g"}, "copy_gbps": copy_gbps, "decode": [], "prefill": [], "quantize": [],
                         "kv": data["kv"], "e2e": None, "verdicts": [], "peers": [], "errors": []})
    assert "| 8192 | ragged | bf16 | 21.0 | 12.6 | 1.67 |" in md and "| 8192 | full | fp16 | 20.0 | 19.0 | 1.05 |" in md
    assert all(x["passes"] for t, x in by.items() if t.startswith(("end to end", "quantize")))


def test_markdown_names_what_did_not_run():
    row = _decode_row(8, 4096, 4096, ours=5.0, bf16=10.0, scaled=float("nan"))
    del row["times_us"]["torch._scaled_mm rowwise"]
    row["summary"] = bench.decode_summary(row, 4000.0)
    data = {"env": {"gpu": "test GPU"}, "copy_gbps": 4000.0, "decode": [row], "prefill": [], "quantize": [],
            "kv": [], "e2e": None, "peers": ["DeepGEMM: unavailable (ImportError: no module)"], "errors": []}
    data["verdicts"] = bench.verdicts(data)
    text = bench.markdown(data)
    assert "# FP8 on test GPU" in text and "DeepGEMM: unavailable" in text
    lines = text.splitlines()
    i = next(j for j, line in enumerate(lines) if line.startswith("| m | r | 8 |"))
    assert lines[i].count("|") == lines[i - 1].count("|") == lines[i - 2].count("|")  # whole rows
    assert lines[i].count("| nan |") == 1 and "| - |" in lines[i]  # a NaN time shown, a missing one a dash


def test_cluster_configs_keep_the_planned_config_but_its_cluster():
    from rosekernels.kernels import gemm_fp8_plan as plan

    shape = plan.Fp8GemmShape(4096, 4096, 4096)
    planned = dataclasses.replace(plan.config_for(shape, 132), stagger=True, raster_group=2)
    others = bench.cluster_configs(planned)
    assert (planned.cluster_m, planned.cluster_n) == (2, 1)
    assert [(c.cluster_m, c.cluster_n) for c in others] == [(1, 1), (1, 2)]
    assert all(dataclasses.replace(c, cluster_m=2, cluster_n=1) == planned for c in others)
    assert [(c.cluster_m, c.cluster_n) for c in bench.cluster_configs(others[0])] == [(2, 1), (1, 2)]


def test_markdown_states_the_end_to_end_arms():
    e2e = {"layers": 4, "scheme": "channel", "us": {"bf16": 1500.0, "fp8": 1200.0, bench.KEEP_FIRST: 1300.0},
           "speedup": 1.25, "min_cos": 0.97, bench.KEEP_FIRST: {"speedup": 1500 / 1300, "min_cos": 0.996}}
    data = {"env": {"gpu": "g"}, "copy_gbps": 4000.0, "decode": [], "prefill": [], "quantize": [], "kv": [],
            "e2e": e2e, "peers": [], "errors": []}
    data["verdicts"] = bench.verdicts(data)
    text = bench.markdown(data)
    assert "FP8 arm 1200.0 us per step (1.25x)" in text and "min 0.9700" in text
    assert "1 of 4; apply(fp8_exclude=['model.layers.0'])): 1300.0 us per step (1.15x), logits cosine min 0.9960" in text
    assert "This run measured" not in text  # every section asked for (none recorded: an older result)
    del e2e[bench.KEEP_FIRST]
    e2e["failed"] = {"fp8": "RuntimeError: capture failed"}
    data["sections"] = ["e2e"]
    text = bench.markdown(data)
    assert "layer 0 in bf16" not in text and "- fp8 did not run: RuntimeError: capture failed" in text
    assert "This run measured e2e only" in text


@pytest.mark.parametrize("argv, message", [(["--scheme", "rowwise"], "invalid choice"),
                                           (["--layers", "x"], "invalid int"),
                                           (["--sections", "prefill,e2f"], "a comma-separated subset of"),
                                           (["--sections", ","], "a comma-separated subset of")])
def test_bad_arguments_exit_2_before_any_work(argv, message):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8.py"), *argv], capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr


def test_the_kv_splits_sweep_marks_the_fastest_split_count():
    """bench/fp8_kv_splits.py's table: per row the fastest split count in bold, it over the plan's pick, and the
    bf16 cache over the plan's pick."""
    import fp8_kv_splits as sweep

    times = {f"{n} splits": 10.0 + abs(n - 4) for n in sweep.SPLITS} | {"planned": 12.0, "bf16 cache": 24.0}
    row = {"heads": "32/8", "batch": 16, "context": 8192, "lengths": "any", "planned_splits": 2, "times_us": times}
    md = sweep.markdown({"env": {"gpu": "GPU"}, "rows": [row]})
    line = next(x for x in md.splitlines() if x.startswith("| 32/8 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == "12.0 (2)" and cells[5 + sweep.SPLITS.index(4)] == "**10.0**"
    assert sum(c.startswith("**") for c in cells) == 1
    assert cells[-2:] == ["0.833", "2.00"]


def test_the_kv_splits_sweep_refuses_a_name_outside_the_sweeps():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_kv_splits.py"), "--name", "fp8_kv_splits"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--name must start with fp8_ and hold _sweep" in run.stderr


def test_the_kv_section_puts_flashinfer_beside_ours_and_says_what_did_not_run():
    """FlashInfer's own e4m3 speedup and its e4m3 time over ours, per row; a row where an arm did not run says
    why; the verdict stays on our caches only."""
    kv = [{"context": 8192, "lengths": "full", "query": "bf16", "errors": {},
           "times_us": {"bf16 cache": 20.0, "e4m3 cache": 12.5, "FlashInfer bf16 cache": 22.0,
                        "FlashInfer e4m3 cache": 15.0}},
          {"context": 8192, "lengths": "full", "query": "fp16",
           "errors": {"FlashInfer e4m3 cache": "RuntimeError: no kernel"},
           "times_us": {"fp16 cache": 20.0, "e4m3 cache": 12.0, "FlashInfer fp16 cache": 21.0}},
          {"context": 8192, "lengths": "ragged", "query": "bf16", "errors": {},
           "times_us": {"bf16 cache": 20.0, "e4m3 cache": 12.0}}]
    md = bench.markdown({"env": {"gpu": "g"}, "copy_gbps": 4000.0, "decode": [], "prefill": [], "quantize": [],
                         "kv": kv, "e2e": None, "verdicts": [], "peers": [], "errors": []})
    assert "| 8192 | full | bf16 | 22.0 | 15.0 | 1.47 | 1.20 |" in md
    assert "| 8192 | full | fp16 | 21.0 | - | - | - |" in md
    assert "- 8192 full fp16: FlashInfer e4m3 cache: RuntimeError: no kernel" in md
    assert "| 8192 | ragged | bf16 | - |" not in md  # a row FlashInfer did not take part in has no peer line
    kv_verdict = next(v for v in bench.verdicts({"kv": kv}) if v["target"].startswith("FP8 KV"))
    assert kv_verdict["worst"] == pytest.approx(20 / 12.5)
