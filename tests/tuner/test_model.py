"""sip-tune --model on the CPU: the (kernel, shape) list of a model's forward pass (Qwen3-8B dense,
Qwen3-30B-A3B MoE), that every listed shape resolves to a config of the mode asked for, --plan, the
no-GPU exit, and the resumable skip of shapes already in the tuned store."""
import dataclasses
import json

import pytest
from devices import HAS_SM90

from rosekernels import models, tuned
from rosekernels.kernels import kernel_module
from rosekernels.device import NO_GPU_EXIT
from sip_tune import cli, configs, model, workloads

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "moe_intermediate_size": 768, "torch_dtype": "bfloat16"}
CONFIGS = {"qwen3-8b": (QWEN3_8B, models.QWEN3_8B), "qwen3-30b-a3b": (QWEN3_30B_A3B, models.QWEN3_30B_A3B)}


def config_file(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name][0]))
    return path


def dims(tmp_path, name):
    found = models.ModelDims.from_config(config_file(tmp_path, name))
    assert dataclasses.replace(found, name=name) == CONFIGS[name][1]
    return found


def by_kernel(found):
    out = {}
    for job in found.jobs:
        out.setdefault(job.kernel, []).append(job.shape)
    return out


def run(capsys, *argv):
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# The shapes

def test_qwen3_8b_decode_runs_the_dense_block_at_every_decode_token_count(tmp_path):
    found = model.shapes(dims(tmp_path, "qwen3-8b"), "decode")
    jobs = by_kernel(found)
    assert set(jobs) == {"gemm_leakyrelu", "attention_decode"}
    gemms = jobs["gemm_leakyrelu"]
    # As rosekernels.hf runs them: q, k and v in one GEMM (32 + 2 x 8 heads of 128), o, the gated MLP gate/up
    # GEMM (2 x 12288 interleaved rows, SwiGLU) and down, at every token count.
    assert {(s["n"], s["k"], s["activation"], s["gated"]) for s in gemms} == {
        (6144, 4096, "none", False), (4096, 4096, "none", False), (24576, 4096, "silu", True),
        (4096, 12288, "none", False)}
    assert sorted({s["m"] for s in gemms}) == list(model.DECODE_TOKENS) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert len(gemms) == 4 * len(model.DECODE_TOKENS)
    attention = jobs["attention_decode"]
    assert [s["batch"] for s in attention] == list(model.DECODE_TOKENS)
    assert all(s["seqlen_kv"] == model.DECODE_CONTEXT and (s["heads_q"], s["heads_kv"], s["head_dim"]) == (32, 8, 128)
               for s in attention)
    # The norms are dropped, and say why: their decode mode has one config (nothing for level 1 to
    # search), and at larger token counts they already run their prefill kernels.
    dropped = {(job.kernel, tuple(sorted(job.shape.items()))): why for job, why in found.dropped}
    assert {kernel for kernel, _ in dropped} == {"qk_norm", "rmsnorm"}
    assert all("one config" in why or "prefill" in why for why in dropped.values())
    assert "one config" in dropped["qk_norm", tuple(sorted(dict(tokens=1, q_heads=32, k_heads=8, head_dim=128,
                                                                 dtype="bf16", rope="bf16").items()))]
    assert "one config" in dropped["rmsnorm", tuple(sorted(dict(rows=1, hidden=4096, dtype="bf16",
                                                                 residual=True).items()))]
    assert "prefill" in dropped["qk_norm", tuple(sorted(dict(tokens=128, q_heads=32, k_heads=8, head_dim=128,
                                                              dtype="bf16", rope="bf16").items()))]


def test_qwen3_30b_a3b_decode_runs_the_experts_and_the_moe_routing_instead_of_a_dense_mlp(tmp_path):
    jobs = by_kernel(model.shapes(dims(tmp_path, "qwen3-30b-a3b"), "decode"))
    assert set(jobs) == {"gemm_leakyrelu", "attention_decode", "moe_route", "moe_dispatch", "grouped_gemm",
                         "moe_combine"}
    # q/k/v in one GEMM (32 + 2 x 4 heads of 128), o (n=hidden, k=32 * 128); no dense MLP: the experts' gate-up
    # (SwiGLU, 2 x 768 rows) and down GEMMs are grouped GEMMs over T x top-8 rows of 128 experts.
    assert {(s["n"], s["k"]) for s in jobs["gemm_leakyrelu"]} == {(5120, 2048), (2048, 4096)}
    assert {(s["n"], s["k"], s["activation"], s["gated"]) for s in jobs["grouped_gemm"]} == {
        (1536, 2048, "silu", True), (2048, 768, "none", False)}
    assert sorted({s["rows"] for s in jobs["grouped_gemm"]}) == [8 * t for t in model.DECODE_TOKENS]
    assert all(s["experts"] == 128 for s in jobs["grouped_gemm"])
    assert [s["tokens"] for s in jobs["moe_dispatch"]] == list(model.DECODE_TOKENS)
    assert all((s["hidden"], s["experts"], s["topk"]) == (2048, 128, 8) for s in jobs["moe_dispatch"])
    assert all((s["hidden"], s["topk"]) == (2048, 8) for s in jobs["moe_combine"])
    # the router after its GEMM: the model's logits and weights dtype, renormalised as its config says
    assert [s["tokens"] for s in jobs["moe_route"]] == list(model.DECODE_TOKENS)
    assert all((s["experts"], s["topk"], s["weight_dtype"], s["renormalize"]) == (128, 8, "bf16", True)
               for s in jobs["moe_route"])
    assert all((s["heads_q"], s["heads_kv"]) == (32, 4) for s in jobs["attention_decode"])


def test_prefill_runs_causal_attention_over_one_sequence_of_each_prefill_token_count(tmp_path):
    found = model.shapes(dims(tmp_path, "qwen3-30b-a3b"), "prefill")
    jobs = by_kernel(found)
    # The expert GEMMs of the shortest chunks (512 and 1024 tokens: 32 and 64 rows per expert) run the
    # swapped decode tiles, a shape of the other mode: dropped, with the reason.
    assert "attention_decode" not in jobs
    assert {(j.kernel, j.tokens) for j, _ in found.dropped} == {("grouped_gemm", 512), ("grouped_gemm", 1024)}
    assert all("decode" in why for _, why in found.dropped)
    assert sorted({s["rows"] for s in jobs["grouped_gemm"]}) == [8 * t for t in model.PREFILL_TOKENS[2:]]
    assert [(s["batch"], s["seqlen"], s["causal"]) for s in jobs["attention"]] == [
        (1, t, True) for t in model.PREFILL_TOKENS]
    assert model.PREFILL_TOKENS == (512, 1024, 2048, 4096, 8192, 16384)
    assert [s["tokens"] for s in jobs["qk_norm"]] == list(model.PREFILL_TOKENS)
    assert [s["tokens"] for s in jobs["moe_combine"]] == list(model.PREFILL_TOKENS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_every_listed_shape_resolves_to_a_config_of_the_mode(tmp_path, name, mode):
    found = model.shapes(dims(tmp_path, name), mode)
    assert found.jobs and len({(j.kernel, j.overrides) for j in found.jobs}) == len(found.jobs)
    for job in found.jobs:
        config, shape = workloads.resolve(job.kernel, mode, job.shape)
        assert config.variant().mode == mode, job
        assert config in kernel_module(job.kernel).candidates(shape)


def test_an_mlp_the_gemm_does_not_take_is_not_listed():
    """An intermediate size that is not a multiple of 8: rosekernels.hf leaves the MLP on torch."""
    odd = dataclasses.replace(models.QWEN3_8B, intermediate=12300)  # 12300 = 8 * 1537 + 4
    found = model.shapes(odd, "decode")
    assert not any(role.startswith("mlp") for role in {j.role for j in found.jobs})
    # q/k/v 6144 x 4096, o 4096 x 4096
    assert {(j.shape["n"], j.shape["k"]) for j in found.jobs if j.kernel == "gemm_leakyrelu"} == {
        (6144, 4096), (4096, 4096)}


# ---------------------------------------------------------------------------------------------
# The command

def test_plan_prints_each_shapes_space_and_a_total(capsys, tmp_path):
    path = config_file(tmp_path, "qwen3-30b-a3b")
    code, out, err = run(capsys, "--model", path, "--mode", "decode", "--plan")
    assert code == 0, err
    found = model.shapes(models.ModelDims.from_config(path), "decode")
    lines = out.splitlines()
    assert sum("candidates (" in line for line in lines) == len(found.jobs)
    assert lines[-1].startswith(f"total: {len(found.jobs)} shapes, ")
    assert f"{len(found.dropped)} shapes dropped" in lines[-1]
    assert sum(line.startswith("  dropped  ") for line in lines) == len(found.dropped)


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "qk_norm"], "not allowed with"),
    (["--levels", "config,sass"], "level 'config' only"),
    (["--shape", "tokens=4"], "--shape is for --kernel"),
])
def test_model_argument_errors_exit_2(capsys, tmp_path, argv, message):
    code, _, err = run(capsys, "--model", config_file(tmp_path, "qwen3-8b"), "--plan", *argv)
    assert code == 2 and message in err


def test_an_unreadable_model_config_exits_2(capsys, tmp_path):
    (tmp_path / "bad.json").write_text("{}")  # no hidden_size
    for path in (tmp_path / "missing.json", tmp_path / "bad.json"):
        code, _, err = run(capsys, "--model", path, "--plan")
        assert code == 2 and f"--model {path}" in err


@pytest.mark.skipif(HAS_SM90, reason="checks the message shown without an sm_90 GPU")
def test_without_a_gpu_tuning_a_model_exits_3_with_one_line(capsys, tmp_path):
    code, out, err = run(capsys, "--model", config_file(tmp_path, "qwen3-8b"), "--mode", "decode")
    assert code == NO_GPU_EXIT == 3 and out == ""
    assert len(err.strip().splitlines()) == 1 and "needs a CUDA sm_90 GPU" in err


# ---------------------------------------------------------------------------------------------
# Resuming

def test_shapes_with_a_stored_entry_for_the_current_heuristic_are_skipped(capsys, tmp_path, monkeypatch):
    """A stored entry for the qk_norm job (its heuristic compiled on the CPU for the hash, about a
    second) skips it; the gemm job, with none, is tuned (by a stand-in for the GPU search)."""
    root = tmp_path / "sip"
    found = model.shapes(models.QWEN3_8B, "prefill")
    norm = next(j for j in found.jobs if j.kernel == "qk_norm" and j.shape["tokens"] == 512)
    gemm = next(j for j in found.jobs if j.kernel == "gemm_leakyrelu" and j.shape["m"] == 512)
    heuristic, shape = workloads.resolve(norm.kernel, "prefill", norm.shape)
    qk_norm = kernel_module("qk_norm")
    original = qk_norm.compile(heuristic).cubin_sha256
    meta = {"heuristic_median_us": 3.0, "tuned_median_us": 2.5, "speedup": 1.2, "aa_spread": 0.01}
    other = next(c for c in qk_norm.candidates(shape) if c != heuristic)
    tuned.store_config(root, qk_norm, shape, other, heuristic, original, meta)  # no checks: below the bar
    assert model.stored_entry(norm, "prefill", root) is None  # tuned again
    tuned.store_config(root, qk_norm, shape, heuristic, heuristic, original, meta, keep_better=False)
    assert model.stored_entry(norm, "prefill", root) is not None  # the heuristic stayed: nothing to check
    assert model.stored_entry(gemm, "prefill", root) is None

    calls = []

    def fake_tune_configs(kernel, mode, overrides, **kw):
        calls.append((kernel, mode, overrides, kw["store_root"], kw["sanitize"]))
        return configs.ConfigReport(kernel, mode, overrides, {}, heuristic_us=10.0, tuned_us=10.0, aa_spread=0.002,
                                    outcome="no candidate timed faster than the heuristic; the heuristic stays",
                                    settled=True)

    monkeypatch.setattr(configs, "tune_configs", fake_tune_configs)
    rows = model.tune(model.ModelShapes(found.dims, "prefill", [norm, gemm], []), store_root=root)
    assert calls == [("gemm_leakyrelu", "prefill", gemm.shape, root, True)]
    assert [r.status for r in rows] == ["skipped: already tuned", "heuristic stays"]
    assert (rows[0].heuristic_us, rows[0].tuned_us, rows[0].speedup) == (3.0, 2.5, 1.2)
    out = capsys.readouterr().out
    assert "[1/2] qk_norm" in out and "[2/2] gemm_leakyrelu" in out
    table = model.table(rows)
    assert "skipped: already tuned" in table and "1.200x" in table and "10.000" in table
    assert table.splitlines()[0].split()[:2] == ["kernel", "shape"]


def test_a_search_whose_checks_failed_to_run_is_reported_as_not_recorded(tmp_path, monkeypatch):
    """No winner and not settled (an op-level process that timed out): the row says nothing was
    recorded, and the gains count the shape as one without an entry."""
    found = model.shapes(models.QWEN3_8B, "decode")
    gemm = next(j for j in found.jobs if j.kernel == "gemm_leakyrelu")
    outcome = "no candidate past the bar held ...; nothing recorded (the next run searches the bucket again)"
    monkeypatch.setattr(configs, "tune_configs", lambda kernel, mode, overrides, **kw: configs.ConfigReport(
        kernel, mode, overrides, {}, heuristic_us=10.0, outcome=outcome))
    rows = model.tune(model.ModelShapes(found.dims, "decode", [gemm], []), store_root=tmp_path, sanitize=False)
    assert [r.status for r in rows] == [f"not recorded: {outcome}"]
    gains = model.gains(rows, "decode", tmp_path)
    assert gains.not_tuned == 1 and "failed to run" in gains.text()
