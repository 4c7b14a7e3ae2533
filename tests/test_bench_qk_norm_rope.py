"""bench/qk_norm_rope.py without a GPU: its stock arm is transformers' Qwen3 prologue, its reference arm the
float64 one, and the table it writes."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import qk_norm_rope as bench  # noqa: E402
from rosekernels.kernels import qk_norm as qkn  # noqa: E402

q3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")


def test_the_stock_arm_is_the_qwen3_attention_prologue():
    """The stock arm against Qwen3Attention's own q_norm / k_norm / apply_rotary_pos_emb on a model's tables,
    and both within bf16's roundings of the float64 norm-then-rotate the rosekernels arm is checked against."""
    hq, hk, d, t = 4, 2, 64, 7
    config = q3.Qwen3Config(hidden_size=256, num_attention_heads=hq, num_key_value_heads=hk, head_dim=d)
    attn = q3.Qwen3Attention(config, layer_idx=0).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data = (torch.randn(d, generator=g) * 0.3 + 1).to(torch.bfloat16)
    q = torch.randn(t, hq * d, generator=g).to(torch.bfloat16)
    k = torch.randn(t, hk * d, generator=g).to(torch.bfloat16)
    _, cos, sin = bench.tables(t, d, torch.Generator().manual_seed(1), device="cpu")
    q_norm, k_norm = bench.norms(attn.q_norm.weight, attn.k_norm.weight)
    got = bench.stock_prologue(q, k, q_norm, k_norm, cos, sin, hq, hk, d)
    want = q3.apply_rotary_pos_emb(attn.q_norm(q.view(1, t, hq, d)).transpose(1, 2),
                                   attn.k_norm(k.view(1, t, hk, d)).transpose(1, 2), cos[None], sin[None])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    refs = qkn.reference(q.view(t, hq, d), k.view(t, hk, d), attn.q_norm.weight, attn.k_norm.weight, bench.EPS, 0.0,
                         cos, sin)
    for a, ref in zip(got, refs):
        err = (a[0].transpose(0, 1).double() - ref).norm() / ref.norm()
        assert err < 2 ** -7, err


def test_flashinfers_table_holds_the_same_rotation_as_the_bf16_rows():
    """cos_sin_cache's row p (cos | sin of p's angles, float32, as FlashInfer and vLLM index it) and tables()'
    bf16 cos and sin rows of the same positions (each angle twice, transformers' layout) agree within bf16's
    rounding, half by half: a table shifted by a position or a frequency, or with its halves swapped, does not."""
    d = 64
    positions, cos, sin = bench.tables(9, d, torch.Generator().manual_seed(2), device="cpu")
    cache = bench.cos_sin_cache(d, device="cpu")
    assert cache.shape == (bench.MAX_POSITION, d) and cache.dtype == torch.float32
    rows = cache[positions]
    for half in (slice(0, d // 2), slice(d // 2, d)):
        assert torch.allclose(rows[:, : d // 2], cos[:, half].float(), atol=2 ** -8, rtol=0)
        assert torch.allclose(rows[:, d // 2:], sin[:, half].float(), atol=2 ** -8, rtol=0)
    assert not torch.allclose(cache[positions + 1][:, : d // 2], cos[:, : d // 2].float(), atol=2 ** -8, rtol=0)


def test_the_peer_bar_takes_a_norm_rounded_before_the_rotation_and_refuses_a_wrong_rotation():
    """errors_of: the reference rounded once to bf16 meets both bars; FlashInfer's order (the norm rounded to
    bf16, then rotated in fp32) stays within the peer bar (two roundings of the terms) though not error()'s; the
    interleaved rotation (GPT-J's pairs, not Qwen3's halves) is far off it."""
    hq, hk, d, t = 4, 2, 64, 33
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(t, hq * d, generator=g) * 3).to(torch.bfloat16)
    k = torch.randn(t, hk * d, generator=g).to(torch.bfloat16)
    wq, wk = ((torch.randn(d, generator=g) * 0.3 + 1).to(torch.bfloat16) for _ in "qk")
    _, cos, sin = bench.tables(t, d, g, device="cpu")
    tol = qkn.tolerance(bench.DTYPE)
    once = [x.to(torch.bfloat16) for x in qkn.reference(q.view(t, hq, d), k.view(t, hk, d), wq, wk, bench.EPS, 0.0,
                                                         cos, sin)]
    strict, terms = bench.errors_of(once, q, k, wq, wk, cos, sin)
    assert strict <= tol and terms <= tol, (strict, terms)

    def rotate(y, pairs):
        y = y.float()
        if pairs:  # GPT-J: (0, 1), (2, 3), ...
            other = torch.stack((-y[..., 1::2], y[..., ::2]), -1).flatten(-2)
        else:
            other = torch.cat((-y[..., d // 2:], y[..., : d // 2]), -1)
        return (y * cos.float()[:, None] + other * sin.float()[:, None]).to(torch.bfloat16)

    normed = [x.to(torch.bfloat16) for x in qkn.reference(q.view(t, hq, d), k.view(t, hk, d), wq, wk, bench.EPS)]
    strict, terms = bench.errors_of([rotate(y, False) for y in normed], q, k, wq, wk, cos, sin)
    assert terms <= 2 * tol < strict, (terms, strict)  # error() would refuse it where the two terms cancel
    _, terms = bench.errors_of([rotate(y, True) for y in normed], q, k, wq, wk, cos, sin)
    assert terms > 20 * tol, terms


def test_the_table_gives_each_arm_over_rosekernels_and_the_a_a_spread():
    us = dict(zip(bench.ARMS, (30.0, 6.0, 9.0, 4.5, 3.0, 3.03)))
    tol = bench.qkn.tolerance(bench.DTYPE)
    row = {"model": "qwen3-8b", "tokens": 16, "us": us, "aa": 0.01, "errors": {"FlashInfer": 1.5 * tol,
                                                                               "rosekernels": 0.5 * tol},
           "speedup": {a: us[a] / 3.0 for a in bench.PEERS}}
    text = bench.markdown({"gpu": "Fake H100"}, [row], ["x: failed"])
    line = next(x for x in text.splitlines() if x.startswith("| qwen3-8b"))
    assert line.split(" | ")[1:] == ["16", "30.00 (10.00x)", "6.00 (2.00x)", "9.00 (3.00x)", "4.50 (1.50x)", "3.00",
                                     "1.0%", "1.50 / 0.50 |"]
    assert "- error: x: failed" in text and "Fake H100" in text


def test_a_peer_that_did_not_run_leaves_its_cell_empty():
    us = {"stock": 30.0, "rosekernels": 3.0, "rosekernels (A/A)": 3.0}
    row = {"model": "qwen3-8b", "tokens": 1, "us": us, "aa": 0.0, "errors": {"rosekernels": 0.0},
           "speedup": {"stock": 10.0}}
    line = next(x for x in bench.markdown({"gpu": "g"}, [row], []).splitlines() if x.startswith("| qwen3-8b"))
    assert line.split(" | ")[2:] == ["30.00 (10.00x)", "-", "-", "-", "3.00", "0.0%", "- / 0.00 |"]


def test_unknown_models_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--models", "gpt-5"])


def test_a_run_records_flashinfers_version_or_why_it_did_not_run(tmp_path, monkeypatch):
    """main() through report.model_sweep: the JSON's env asks for FlashInfer's version, and where its import fails
    the markdown says so; the rows are measure()'s (stood in for: no GPU here)."""
    import json

    import report

    asked = []
    monkeypatch.setattr(report, "require_gpu", lambda: None)
    monkeypatch.setattr(report, "environment", lambda peers=(): asked.append(peers) or {"gpu": "Fake", "peers": peers})
    us = {"stock": 30.0, "rosekernels": 3.0, "rosekernels (A/A)": 3.0}

    def fake(model, tokens, rounds, flashinfer):
        assert flashinfer is None and rounds == 2
        return {"model": model, "tokens": tokens, "us": us, "aa": 0.0, "errors": {"rosekernels": 0.1},
                "speedup": {"stock": 10.0}}

    monkeypatch.setattr(bench, "measure", fake)

    def no_flashinfer():
        raise ImportError("No module named 'flashinfer'")

    monkeypatch.setattr(bench, "flashinfer_arm", no_flashinfer)
    assert bench.main(["--out", str(tmp_path), "--models", "qwen3-8b", "--tokens", "1,16", "--rounds", "2"]) == 0
    assert asked == [("flashinfer",)]
    data = json.loads((tmp_path / report.folder("qk_norm_rope") / "qk_norm_rope.json").read_text())
    assert [r["tokens"] for r in data["rows"]] == [1, 16] and data["env"]["peers"] == ["flashinfer"]
    text = (tmp_path / report.folder("qk_norm_rope") / "qk_norm_rope.md").read_text()
    assert "- error: FlashInfer: unavailable (ImportError: No module named 'flashinfer')" in text
