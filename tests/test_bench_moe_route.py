"""bench/moe_route.py without a GPU: the torch arm is transformers' router, and the table it writes."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import moe_route as bench  # noqa: E402

pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe as q3m  # noqa: E402


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_torch_arm_is_the_stock_router(renormalize):
    config = q3m.Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize)
    router = q3m.Qwen3MoeTopKRouter(config).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    h = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _, want_w, want_ids = router(h)
    got_w, got_ids = bench.torch_router(h, router.weight, 4, renormalize)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_the_table_gives_the_speedup_and_the_a_a_spread():
    row = {"model": "mixtral-8x7b", "experts": 8, "topk": 2, "tokens": 16, "renormalize": True,
           "us": {"torch": 20.0, "rosekernels": 8.0, "rosekernels (A/A)": 8.08}, "speedup": 2.5, "aa": 0.01}
    text = bench.markdown({"gpu": "Fake H100"}, [row], ["x: failed"])
    line = next(x for x in text.splitlines() if x.startswith("| mixtral"))
    assert line.split(" | ")[1:] == ["8", "2", "16", "20.00", "8.00", "2.50x", "1.0% |"]
    assert "- error: x: failed" in text and "Fake H100" in text


def test_unknown_models_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--models", "gpt-5"])
