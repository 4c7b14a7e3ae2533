"""rosekernels.hf without a GPU: the plan of Qwen3 / Qwen3-MoE models (meta device), the refusal to
apply without a GPU, the swapped modules falling back to exactly the stock computation, and the glue
around the attention and MoE ops, run with stand-ins that follow the ops' documented contracts."""
import copy
import types

import pytest
import torch

pytest.importorskip("transformers")

import rosekernels  # noqa: E402
from rosekernels import hf  # noqa: E402
from rosekernels.kernels import moe_route  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig  # noqa: E402
from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=997, rms_norm_eps=1e-5)


def _tiny(moe: bool, layers: int, device: str = "cpu", **extra):
    config = (Qwen3MoeConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=96, norm_topk_prob=True,
                             num_hidden_layers=layers, **TINY, **extra) if moe
              else Qwen3Config(num_hidden_layers=layers, **TINY, **extra))
    return hf.random_model(config, device=device)


# ---------------------------------------------------------------------------------------------
# The plan


@pytest.mark.parametrize("geometry, layers", [("qwen3-8b", 3), ("qwen3-30b-a3b", 2)])
def test_plan_of_the_released_geometries_lists_every_module_once(geometry, layers):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.model_config(geometry, layers), dtype=torch.bfloat16)
    p = hf.plan(model)
    moe = geometry == "qwen3-30b-a3b"
    assert p.model_type == ("qwen3_moe" if moe else "qwen3")
    # per layer: input, post-attention, q and k norms; plus the final norm
    assert len(p.swaps["rmsnorm"]) == 4 * layers + 1
    assert p.swaps["attention"] == tuple(f"model.layers.{i}.self_attn" for i in range(layers))
    assert p.swaps["qkv"] == p.swaps["attention"]  # q, k and v in one GEMM
    assert p.swaps["decoder_layer"] == tuple(f"model.layers.{i}" for i in range(layers))
    assert p.swaps["experts"] == (tuple(f"model.layers.{i}.mlp.experts" for i in range(layers)) if moe else ())
    assert p.swaps["mlp"] == (() if moe else tuple(f"model.layers.{i}.mlp" for i in range(layers)))
    assert "model.norm" in p.swaps["rmsnorm"] and "model.layers.0.self_attn.k_norm" in p.swaps["rmsnorm"]
    text = str(p)
    assert f"{layers:4d} x MoE experts" in text if moe else "   0 x MoE experts" in text


def test_plan_gives_the_dense_layers_of_a_moe_model_the_gated_gemm():
    model = _tiny(moe=True, layers=4, device="meta", mlp_only_layers=[1, 2])
    assert hf.plan(model).swaps["experts"] == ("model.layers.0.mlp.experts", "model.layers.3.mlp.experts")
    assert hf.plan(model).swaps["mlp"] == ("model.layers.1.mlp", "model.layers.2.mlp")


def test_plan_leaves_an_mlp_the_gated_gemm_cannot_take_to_torch():
    for change in (dict(intermediate_size=380), dict(hidden_act="gelu")):  # 380: not a multiple of 8
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen3Config(**{**TINY, **change}, num_hidden_layers=1))
        assert hf.plan(model).swaps["mlp"] == () and hf.plan(model).swaps["attention"]


def test_plan_skips_an_attention_whose_q_and_k_norms_differ():
    model = _tiny(moe=False, layers=2, device="meta")
    model.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3  # one qk_norm launch has one eps
    assert hf.plan(model).swaps["attention"] == ("model.layers.0.self_attn",)


def test_plan_refuses_other_models():
    with torch.device("meta"):
        llama = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY.items()}, num_hidden_layers=1))
    with pytest.raises(ValueError, match="Qwen3 and Qwen3-MoE.*'llama'"):
        hf.plan(llama)
    with pytest.raises(ValueError, match="Qwen3 and Qwen3-MoE.*'llama'"):  # before its names are read as a Qwen3's
        hf.plan(llama, fp8="channel", fp8_exclude=["model.layers.0"])
    with pytest.raises(ValueError, match="got None"):
        hf.plan(torch.nn.Linear(2, 2))


def test_plan_refuses_a_transformers_release_its_forwards_do_not_follow(monkeypatch):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**TINY, num_hidden_layers=1))
    assert hf.plan(model).swaps["attention"]
    monkeypatch.setattr(hf.transformers, "__version__", "5.24.0")
    with pytest.raises(ValueError, match="follows transformers 5.17.x's Qwen3 code; this is transformers 5.24.0"):
        hf.plan(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_apply_without_a_gpu_refuses_in_one_line_and_changes_nothing():
    model = _tiny(moe=True, layers=2)
    classes = [type(m) for m in model.modules()]
    with pytest.raises(RuntimeError) as e:
        hf.apply(model)
    assert "\n" not in str(e.value) and "sm_90 GPU" in str(e.value) and "no CUDA device" in str(e.value)
    assert [type(m) for m in model.modules()] == classes
    assert (model.config._attn_implementation, model.config._experts_implementation) == ("sdpa", "grouped_mm")


# ---------------------------------------------------------------------------------------------
# The swapped model, every op falling back (CPU tensors)


@pytest.mark.parametrize("moe", [False, True])
def test_swapped_model_on_the_cpu_falls_back_to_exactly_the_stock_computation(moe):
    stock = _tiny(moe, layers=3)
    ours = copy.deepcopy(stock)
    hf._swap(ours, hf.plan(ours))
    hf._swap(ours, hf.plan(ours))  # idempotent: nothing left to plan, nothing changes
    assert all(names == () for names in hf.plan(ours).swaps.values())
    assert type(ours.model.layers[0]).__name__.startswith("RoseQwen3")
    assert ours.config._attn_implementation == "rosekernels"
    assert ours.config._experts_implementation == ("rosekernels" if moe else "eager")
    if moe:
        assert ours.model.layers[0].mlp.experts._rosekernels_fallback == "grouped_mm"
    ids = torch.randint(0, TINY["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(3))
    hf.reset_stats()
    with torch.inference_mode():
        want, got = stock(ids).logits, ours(ids).logits
        # decode steps with a cache: the fused layer and the attention function on S_q = 1
        want_gen = stock.generate(ids, max_new_tokens=4, do_sample=False)
        got_gen = ours.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(want, got)
    assert torch.equal(want_gen, got_gen)
    calls = 2 + 3  # two forwards of the prompt (one inside generate), then three decode steps
    # per layer: input and post-attention norms, and the q and k norms the qk fallback calls; the final norm
    expected = {"fallback:rmsnorm:device": calls * (4 * 3 + 1), "fallback:qk_norm:device": calls * 3,
                "fallback:attention:device": calls * 3, "fallback:gemm:device": calls * 2 * 3}  # q/k/v, o
    if moe:
        expected["fallback:experts:device"] = expected["fallback:router:device"] = calls * 3
    else:
        expected["fallback:mlp:device"] = calls * 3
    assert hf.stats() == expected


# ---------------------------------------------------------------------------------------------
# The glue around the ops, with stand-ins that follow the ops' contracts


def _reference_attention(q, k, v, causal=False, softmax_scale=None):
    """rosekernels.attention's contract: [B, S, H, d] operands, GQA, causal aligned bottom-right."""
    s_q, s_k, ratio = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(ratio, 1), vh.repeat_interleave(ratio, 1)
    s = qh @ kh.transpose(-1, -2) * (softmax_scale or q.shape[-1] ** -0.5)
    if causal:
        i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
        s = s.masked_fill(j > i + s_k - s_q, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2).to(q.dtype)


@pytest.mark.parametrize("s_q, s_kv", [(37, 37), (1, 45), (20, 64), (3, 10)])
def test_attention_function_means_what_sdpa_means_and_passes_views(monkeypatch, s_q, s_kv):
    """Prefill, a decode step, a static cache's prefill (keys past S_q are stale) and a short chunk:
    the registered function's result equals sdpa's, and the op gets views of q, k, v (no copies)."""
    seen = []

    def op(q, k, v, causal=False, softmax_scale=None):
        seen.append((q, k, v))
        return _reference_attention(q, k, v, causal, softmax_scale)

    monkeypatch.setattr(rosekernels, "attention", op, raising=False)
    real = hf._attention_refusal
    monkeypatch.setattr(hf, "_attention_refusal", lambda *a: None if real(*a) == "device" else real(*a))
    g = torch.Generator().manual_seed(s_q * 100 + s_kv)
    # the layouts transformers hands over: q transposed from [B, S, H, d], k/v as the cache stores them
    query = torch.randn(2, s_q, 8, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(2, 2, s_kv, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=4)
    hf.reset_stats()
    got, weights = hf.attention_forward(module, query, key, value, None, scaling=0.1)
    want, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), None, scaling=0.1)
    assert weights is None and got.shape == (2, s_q, 8, 64)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    (q, k, v), = seen
    for passed, given in ((q, query), (k, key), (v, value)):
        assert passed.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
    assert hf.stats() == {"attention_decode" if s_q <= 16 else "attention_prefill": 1}


def test_attention_function_falls_back_to_sdpa_for_a_mask_and_counts_it():
    g = torch.Generator().manual_seed(7)
    query = torch.randn(1, 4, 5, 64, generator=g).to(torch.bfloat16)
    key, value = (torch.randn(1, 2, 9, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = torch.rand(1, 1, 5, 9, generator=g) > 0.3
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)
    hf.reset_stats()
    got, _ = hf.attention_forward(module, query, key, value, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
    assert torch.equal(got, want)
    assert hf.stats() == {"fallback:attention:mask": 1}


def _reference_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
    """attention_with_kvcache's contract (contiguous cache): sequence b attends causally, aligned
    bottom-right, to its first cache_seqlens[b] keys; rows past them are never read."""
    outs = []
    for b, n in enumerate(cache_seqlens.tolist()):
        outs.append(_reference_attention(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], True, softmax_scale))
    return torch.cat(outs)


def _static_decode_mask(s_q, offset, kv_length=20, batch=2, **kw):
    """The mask transformers builds for a static cache's decode step of s_q tokens after `offset`."""
    args = dict(batch_size=batch, q_length=s_q, kv_length=kv_length, q_offset=offset, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=False, device="cpu")
    return hf.prefix_mask(**(args | kw))


@pytest.mark.parametrize("s_q, offset", [(1, 7), (3, 5), (16, 0)])
def test_a_static_cache_decode_step_runs_the_kvcache_kernel_with_counts_from_its_mask(monkeypatch, s_q, offset):
    """Stale keys past each sequence's count hold NaN: they must get no weight."""
    seen = []

    def op(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
        seen.append((q, k_cache, cache_seqlens.clone()))
        return _reference_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale)

    monkeypatch.setattr(rosekernels, "attention_with_kvcache", op, raising=False)
    real = hf._attention_refusal
    monkeypatch.setattr(hf, "_attention_refusal", lambda *a: None if real(*a) == "device" else real(*a))
    mask = _static_decode_mask(s_q, offset)
    g = torch.Generator().manual_seed(s_q)
    query = torch.randn(2, s_q, 8, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    key, value = (torch.randn(2, 2, 20, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    key[:, :, offset + s_q:], value[:, :, offset + s_q:] = float("nan"), float("nan")
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=4)
    hf.reset_stats()
    got, _ = hf.attention_forward(module, query, key, value, mask, scaling=0.1)
    want, _ = sdpa_attention_forward(module, query.float(), key.float().nan_to_num(), value.float().nan_to_num(),
                                     mask, scaling=0.1)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    (q, k_cache, counts), = seen
    assert counts.tolist() == [offset + s_q] * 2 and counts.dtype == torch.int32
    assert k_cache.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()  # the cache, not a copy
    assert hf.stats() == {"attention_decode": 1}


def test_masks_with_padding_or_another_pattern_are_not_marked_and_fall_back():
    ones, padded = torch.ones(2, 8, dtype=torch.bool), torch.ones(2, 8, dtype=torch.bool)
    padded[1, :2] = False  # left padding: the visible keys are not a prefix
    assert _static_decode_mask(1, 7, attention_mask=ones)._rosekernels_key_counts.tolist() == [8, 8]
    assert not hasattr(_static_decode_mask(1, 7, attention_mask=padded), "_rosekernels_key_counts")
    window = _static_decode_mask(1, 7, mask_function=sliding_window_causal_mask_function(4))
    assert not hasattr(window, "_rosekernels_key_counts")
    for other in (dict(local_size=4), dict(kv_offset=1)):
        assert hasattr(_static_decode_mask(1, 7), "_rosekernels_key_counts")
        assert not hasattr(_static_decode_mask(1, 7, **other), "_rosekernels_key_counts"), other
    # A 2D mask shorter than the keys the last query sees: sdpa pads it with False, which hides keys
    # from the earlier rows of a multi-token step; only one that covers them all is marked.
    assert not hasattr(_static_decode_mask(3, 5, attention_mask=ones[:, :6]), "_rosekernels_key_counts")
    assert _static_decode_mask(3, 5, attention_mask=ones)._rosekernels_key_counts.tolist() == [8, 8]
    query = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    key = torch.zeros(2, 2, 20, 64, dtype=torch.bfloat16)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)
    hf.reset_stats()
    hf.attention_forward(module, query, key, key, _static_decode_mask(1, 7, attention_mask=padded))
    assert hf.stats() == {"fallback:attention:mask": 1}


def test_a_marked_mask_refused_for_another_reason_counts_that_reason():
    query = torch.zeros(2, 4, 1, 64)  # float32: the kernels take bf16 and fp16
    key = torch.zeros(2, 2, 20, 64)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)
    hf.reset_stats()
    hf.attention_forward(module, query, key, key, _static_decode_mask(1, 7))
    assert hf.stats() == {"fallback:attention:dtype": 1}


def test_a_mask_marked_before_a_compiled_forward_keeps_its_mark(monkeypatch):
    """generate() builds the masks eagerly and calls the compiled forward with them: the mark crosses
    into the traced code, and the KV-cache kernel serves the step there."""
    calls = []

    def op(q, k_cache, v_cache, cache_seqlens, softmax_scale=None):
        calls.append(1)
        return _reference_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale)

    monkeypatch.setattr(rosekernels, "attention_with_kvcache", op, raising=False)
    real = hf._attention_refusal
    monkeypatch.setattr(hf, "_attention_refusal", lambda *a: None if real(*a) == "device" else real(*a))
    g = torch.Generator().manual_seed(11)
    query = torch.randn(2, 4, 2, 64, generator=g).to(torch.bfloat16)
    key, value = (torch.randn(2, 2, 20, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = _static_decode_mask(2, 9)
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=2)
    torch._dynamo.reset()
    got, _ = torch.compile(hf.attention_forward, backend="eager")(module, query, key, value, mask, scaling=0.1)
    torch._dynamo.reset()
    want, _ = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, scaling=0.1)
    assert calls
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_attention_refusals():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 6, 64, dtype=torch.bfloat16)
    assert hf._attention_refusal(q, k, k, torch.ones(1, 1, 2, 6, dtype=torch.bool), 0.0, {}) == "mask"
    assert hf._attention_refusal(q, k, k, None, 0.1, {}) == "dropout"
    assert hf._attention_refusal(q.float(), k.float(), k.float(), None, 0.0, {}) == "dtype"
    odd = torch.zeros(1, 4, 2, 96, dtype=torch.bfloat16)
    assert hf._attention_refusal(odd, odd, odd, None, 0.0, {}) == "head_dim"
    assert hf._attention_refusal(q, k, k, None, 0.0, {}) == "device"
    assert hf._strides_ok(k.transpose(1, 2)) and not hf._strides_ok(torch.zeros(3, 2, 130)[..., :64])


def _dispatch_standin(x, topk_ids, num_experts, block_size=128):
    """moe_dispatch's contract at block size 1: expert e's tokens in rows offsets[e] .. offsets[e+1]-1,
    in any order within the expert (the prefill variant's order is not deterministic: shuffled here),
    slot_map[t, j] the row of pair (t, j)."""
    assert block_size == 1 and topk_ids.dtype == torch.int32
    pairs = topk_ids.flatten().long()
    order = torch.argsort(pairs * len(pairs) + torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1)))
    slot = torch.empty_like(pairs)
    slot[order] = torch.arange(len(pairs))
    counts = torch.bincount(pairs, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
    return types.SimpleNamespace(buffer=x[order // topk_ids.shape[1]], offsets=offsets,
                                 slot_map=slot.view(topk_ids.shape).int())


def _combine_standin(expert_out, topk_weights, slot_map):
    """moe_combine's contract: out[t] = sum_j w[t, j] * expert_out[slot_map[t, j]], fp32 accumulation."""
    rows = expert_out.float()[slot_map.long()]
    return (rows * topk_weights.float()[..., None]).sum(1).to(expert_out.dtype)


def test_experts_glue_groups_the_gemms_by_the_dispatch_offsets(monkeypatch):
    """The grouped GEMMs over the dispatch buffer (torch._grouped_mm runs on the CPU too), then the
    combine: the stock grouped_mm experts' result, on a ragged routing with an expert left empty."""
    monkeypatch.setattr(rosekernels, "moe_dispatch", _dispatch_standin, raising=False)
    monkeypatch.setattr(rosekernels, "moe_combine", _combine_standin, raising=False)
    monkeypatch.setattr(hf, "_experts_refusal", lambda *args: None)
    experts = _tiny(moe=True, layers=1).model.layers[0].mlp.experts
    experts._rosekernels_path = "grouped_mm"  # as apply(model, experts="grouped_mm") marks them
    g = torch.Generator().manual_seed(11)
    tokens = 37
    hidden = torch.randn(tokens, TINY["hidden_size"], generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(tokens)])  # expert 7 gets no token
    weights = torch.rand(tokens, 3, generator=g).softmax(-1).to(torch.bfloat16)
    hf.reset_stats()
    got = hf.experts_forward(experts, hidden, ids, weights)
    want = grouped_mm_experts_forward(experts, hidden, ids, weights)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"relative error {err:.3g}"
    assert hf.stats() == {"experts": 1}


def _moe_experts_standin(x, w_gate_up, w_down, topk_ids, topk_weights):
    """rosekernels.moe_experts' contract: sum_j w[t, j] * down[e](silu(gate[e] x) * up[e] x) with w_gate_up
    [E, 2I, H] holding expert e's gate rows then its up rows, ids int32 (-1: no expert), fp32 sums; the
    intermediate rounded to x's dtype as the kernels store it."""
    assert topk_ids.dtype == torch.int32 and w_gate_up.shape[1] == 2 * w_down.shape[2]
    inter = w_down.shape[2]
    out = torch.zeros(x.shape)
    for t, j in zip(*(topk_ids >= 0).nonzero(as_tuple=True)):
        e = int(topk_ids[t, j])
        y = x[t].float() @ w_gate_up[e].float().t()
        h = (torch.nn.functional.silu(y[:inter]) * y[inter:]).to(x.dtype).float()
        out[t] += float(topk_weights[t, j]) * (h @ w_down[e].float().t()).to(x.dtype).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_experts_on_the_moe_experts_path_compute_the_stock_experts(monkeypatch, dtype):
    """apply(experts="moe_experts"): the experts hand their weights as stored and int32 ids to
    rosekernels.moe_experts (a stand-in following its contract): the stock experts' result."""
    monkeypatch.setattr(rosekernels, "moe_experts", _moe_experts_standin, raising=False)
    model = _tiny(moe=True, layers=1).to(dtype)
    stock = copy.deepcopy(model.model.layers[0].mlp.experts)
    p = hf.plan(model, experts="moe_experts")
    assert p.experts == "moe_experts" and "rosekernels.moe_experts" in str(p)
    hf._swap(model, p)
    experts = model.model.layers[0].mlp.experts
    assert experts._rosekernels_path == "moe_experts"
    monkeypatch.setattr(hf, "_experts_refusal", lambda e, h, path: None if path == "moe_experts" else "path")
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(23, TINY["hidden_size"], generator=g).to(dtype)
    ids = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(23)])  # int64, as the router gives them
    weights = torch.rand(23, 3, generator=g).softmax(-1).to(dtype)
    hf.reset_stats()
    got = hf.experts_forward(experts, hidden, ids, weights)
    want = grouped_mm_experts_forward(stock, hidden, ids, weights)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert got.dtype == dtype and err < 1e-2, f"relative error {err:.3g}"
    assert hf.stats() == {"experts": 1}


def _route_standin(logits, topk, renormalize=True, *, weight_dtype=None):
    """rosekernels.moe_route's contract: its float64 reference (the k largest logits, the lower expert first
    among equal ones; softmax weights, renormalised or not), weights in weight_dtype, ids int32."""
    weights, ids = moe_route.reference(logits, topk, renormalize)
    return weights.to(weight_dtype or torch.float32), ids.to(torch.int32)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_a_served_moe_block_routes_with_moe_route_as_the_stock_router_does(monkeypatch, norm_topk_prob):
    """apply(): the router's softmax and top-k go to rosekernels.moe_route (a stand-in following its
    contract) with the weights in the logits' dtype and int32 ids: the stock router's choice and weights
    (logits without ties), and the stock MoE block's output through the moe_experts path."""
    monkeypatch.setattr(rosekernels, "moe_route", _route_standin, raising=False)
    monkeypatch.setattr(rosekernels, "moe_experts", _moe_experts_standin, raising=False)
    monkeypatch.setattr(hf, "_router_refusal", lambda h: None)
    monkeypatch.setattr(hf, "_experts_refusal", lambda e, h, path: None)
    model = _tiny(moe=True, layers=1)
    model.config.norm_topk_prob = model.model.layers[0].mlp.gate.norm_topk_prob = norm_topk_prob
    stock = copy.deepcopy(model.model.layers[0].mlp)
    p = hf.plan(model, experts="moe_experts")
    assert p.swaps["router"] == ("model.layers.0.mlp",) and "rosekernels.moe_route" in str(p)
    hf._swap(model, p)
    block = model.model.layers[0].mlp
    assert type(block.gate) is hf.RoseQwen3MoeTopKRouter and not hf.plan(model).swaps["router"]  # once
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 11, TINY["hidden_size"], generator=g).to(torch.bfloat16)
    hf.reset_stats()
    with torch.inference_mode():
        logits, weights, ids = block.gate(hidden)
        want_logits, want_weights, want_ids = stock.gate(hidden)
        assert torch.equal(logits, want_logits) and ids.dtype == torch.int32 and weights.dtype == torch.bfloat16
        assert torch.equal(ids.long(), want_ids) and torch.equal(weights, want_weights)
        got, want = block(hidden).float(), stock(hidden).float()
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, f"relative error {err:.3g}"
    assert hf.stats() == {"router": 2, "experts": 1}


def test_the_patched_router_gives_int64_ids_once_the_experts_leave_rosekernels(monkeypatch):
    monkeypatch.setattr(rosekernels, "moe_route", _route_standin, raising=False)
    monkeypatch.setattr(hf, "_router_refusal", lambda h: None)
    model = _tiny(moe=True, layers=1)
    hf._swap(model, hf.plan(model, experts="moe_experts"))
    gate = model.model.layers[0].mlp.gate
    h = torch.randn(5, TINY["hidden_size"]).to(torch.bfloat16)
    with torch.inference_mode():
        assert gate(h)[2].dtype == torch.int32
        model.set_experts_implementation("eager")
        assert gate(h)[2].dtype == torch.int64


def test_a_stock_experts_fallback_gets_int64_ids_from_the_patched_router(monkeypatch):
    """moe_route's ids are int32; where experts_forward falls back to the stock experts (whose eager loop
    indexes with one_hot, int64 only) it hands them int64 ids: the stock result."""
    model = _tiny(moe=True, layers=1)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(13, TINY["hidden_size"], generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(13)])
    weights = torch.rand(13, 3, generator=g).softmax(-1).to(torch.bfloat16)
    monkeypatch.setattr(experts, "_rosekernels_fallback", "eager", raising=False)
    want = type(experts).forward.__wrapped__(experts, hidden, ids, weights)  # the stock eager loop, int64 ids
    hf.reset_stats()
    got = hf.experts_forward(experts, hidden, ids.to(torch.int32), weights)  # CPU: the fallback
    assert hf.stats() == {"fallback:experts:device": 1} and torch.equal(got, want)


def test_the_experts_path_is_one_of_two_and_switches_the_warmup_set():
    assert hf.EXPERTS_PATH in hf.EXPERTS_WHAT and set(hf.EXPERTS_WHAT) == {"grouped_mm", "moe_experts"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.model_config("qwen3-30b-a3b", 1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="experts must be one of"):
        hf.plan(model, experts="loop")
    grouped = [s for s in hf.warmup_specs(model, experts="moe_experts") if s.variant().op == "grouped_gemm"]
    assert {(s.activation, s.gated) for s in grouped} == {("silu", True), ("none", False)}
    assert {s.mode for s in grouped} == {"decode", "prefill"}
    assert not [s for s in hf.warmup_specs(model, experts="grouped_mm") if s.variant().op == "grouped_gemm"]


def test_the_installed_experts_path_is_the_default_and_another_is_refused():
    """After apply(experts="moe_experts") (its module swaps: apply itself needs a GPU), plan and the
    warm-up default to the installed path (its grouped GEMMs compiled up front, not at the first served
    call), and asking for the other path raises instead of silently keeping this one."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.model_config("qwen3-30b-a3b", 1), dtype=torch.bfloat16)
    other = "grouped_mm" if hf.EXPERTS_PATH == "moe_experts" else "moe_experts"
    hf._swap(model, hf.plan(model, experts=other))
    assert model.model.layers[0].mlp.experts._rosekernels_path == other
    assert hf.plan(model).experts == other and hf.plan(model, experts=other).experts == other
    grouped = [s for s in hf.warmup_specs(model) if s.variant().op == "grouped_gemm"]
    assert bool(grouped) == (other == "moe_experts")
    with pytest.raises(ValueError, match=f"already run on '{other}'"):
        hf.plan(model, experts=hf.EXPERTS_PATH)
    with pytest.raises(ValueError, match=f"already run on '{other}'"):
        hf.warmup_specs(model, experts=hf.EXPERTS_PATH)


def _gemm_standin(a, w, bias=None, activation=None, gated=False):
    """rosekernels.gemm's contract: act(a @ w^T + bias), or gated act(gate) * up over w's rows interleaved
    in blocks of 8 (the kernel module's own epilogue reference), fp32 accumulation, a's dtype out."""
    from rosekernels.kernels.gemm_leakyrelu import epilogue_reference

    y = a.float() @ w.float().t() + (0 if bias is None else bias.float())
    return epilogue_reference(y, activation or "none", gated).to(a.dtype)


def test_mlp_and_projection_glue_computes_the_stock_mlp_and_linears(monkeypatch):
    """The patched MLP (one gated GEMM over the interleaved gate/up weight, then down), the q, k and v
    projections (one GEMM over their rows, its output sliced) and o, through a stand-in for rosekernels.gemm:
    the stock modules' results."""
    monkeypatch.setattr(rosekernels, "gemm", _gemm_standin, raising=False)
    monkeypatch.setattr(hf, "_gemm_refusal", lambda *args: None)
    stock = _tiny(moe=False, layers=1).to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    hf._swap(ours, hf.plan(ours))
    x = torch.randn(3, 5, TINY["hidden_size"], generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    hf.reset_stats()
    attn, ref = ours.model.layers[0].self_attn, stock.model.layers[0].self_attn
    with torch.inference_mode():
        q, k, v = hf._qkv(attn, x)
        pairs = [(ours.model.layers[0].mlp(x), stock.model.layers[0].mlp(x)), (q, ref.q_proj(x)),
                 (k, ref.k_proj(x)), (v, ref.v_proj(x)), (hf._linear(attn.o_proj, x), ref.o_proj(x))]
        for got, want in pairs:
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < 1e-2, f"relative error {err:.3g}"
    assert hf.stats() == {"mlp": 1, "gemm": 2}  # q, k and v in one GEMM


def _qk_norm_standin(q, k, q_weight, k_weight=None, eps=1e-6, weight_bias=0.0, *, cos=None, sin=None):
    """rosekernels.qk_norm's contract (the kernel module's float64 reference, rounded once), which takes cos and
    sin only as [T, d] rows."""
    from rosekernels.kernels.qk_norm import reference

    assert cos is None or (cos.shape == sin.shape == (q.shape[0], q.shape[-1]))
    out = reference(q, k, q_weight, q_weight if k_weight is None else k_weight, eps, weight_bias, cos, sin)
    return tuple(o.to(q.dtype) for o in out)


@pytest.mark.parametrize("batch_of_tables, table_dtype, served", [
    (2, torch.bfloat16, "qk_norm"), (1, torch.bfloat16, "qk_norm"), (2, torch.float32, "fallback:rope:dtype"),
    (2, torch.float16, "fallback:rope:dtype")])
def test_the_norms_and_the_rotary_embedding_go_to_one_qk_norm_call(monkeypatch, batch_of_tables, table_dtype, served):
    """The patched attention's q/k prologue through a stand-in for rosekernels.qk_norm: the stock q_norm, k_norm
    and apply_rotary_pos_emb, with the rotary tables in the call (a [1, S, d] table spread over the batch)
    where the result is stock's, dtype included, else the stock rotation after the norms, counted."""
    monkeypatch.setattr(rosekernels, "qk_norm", _qk_norm_standin, raising=False)
    monkeypatch.setattr(hf, "_qk_norm_refusal", lambda *args: None)
    stock = _tiny(moe=False, layers=1).to(torch.bfloat16)
    ours = copy.deepcopy(stock)
    hf._swap(ours, hf.plan(ours))
    attn, ref = ours.model.layers[0].self_attn, stock.model.layers[0].self_attn
    g = torch.Generator().manual_seed(7)
    d, (b, s) = TINY["head_dim"], (2, 5)
    q = torch.randn(b, s, TINY["num_attention_heads"] * d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, s, TINY["num_key_value_heads"] * d, generator=g).to(torch.bfloat16)
    positions = torch.arange(100, 100 + s)[None] + torch.tensor([[0], [37]])[:batch_of_tables]  # rows differ
    cos, sin = (t.to(table_dtype) for t in stock.model.rotary_emb(q, positions))
    hf.reset_stats()
    with torch.inference_mode():
        got = hf._normed_qk(attn, q, k, (b, s, -1, d), cos, sin)
        want = apply_rotary_pos_emb(ref.q_norm(q.view(b, s, -1, d)).transpose(1, 2),
                                       ref.k_norm(k.view(b, s, -1, d)).transpose(1, 2), cos, sin)
    for x, y in zip(got, want):
        assert x.shape == y.shape and x.dtype == y.dtype  # (fp16 tables make stock's rotation fp32, as ours)
        err = (x.float() - y.float()).norm() / y.float().norm()
        assert err < 1e-2, f"relative error {err:.3g}"
    assert hf.stats() == ({"qk_norm": 1} if served == "qk_norm" else {"qk_norm": 1, served: 1})


def test_rope_refusals():
    """qk_norm takes a row of d values per token, [B or 1, S or 1, d], in q's dtype (the op takes fp32 tables too,
    but stock's rotation by them returns fp32 heads)."""
    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype)

    rows, d, bf16 = (2, 5), 64, torch.bfloat16
    for shape in ((2, 5, 64), (1, 5, 64), (2, 1, 64)):
        assert hf._rope_refusal(t(*shape), t(*shape), rows, d, bf16) is None
    for cos, sin in ((t(2, 5, 32), t(2, 5, 32)), (t(3, 5, 64), t(3, 5, 64)), (t(5, 64), t(5, 64)),
                     (t(2, 5, 64), t(1, 5, 64)), (t(1, 2, 5, 64), t(1, 2, 5, 64))):
        assert hf._rope_refusal(cos, sin, rows, d, bf16) == "shape", cos.shape
    for cos, sin in ((t(2, 5, 64, dtype=torch.float16),) * 2, (t(2, 5, 64, dtype=torch.float32),) * 2,
                     (t(2, 5, 64), t(2, 5, 64, dtype=torch.float32))):
        assert hf._rope_refusal(cos, sin, rows, d, bf16) == "dtype"


def test_projections_that_are_not_plain_linears_keep_their_own_forward(monkeypatch):
    """A hooked (or subclassed: LoRA, quantized) projection is not replaced by the GEMM: its forward runs."""
    monkeypatch.setattr(rosekernels, "gemm", _gemm_standin, raising=False)
    monkeypatch.setattr(hf, "_gemm_refusal", lambda *args: None)
    model = _tiny(moe=False, layers=2).to(torch.bfloat16)
    seen = []
    model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.model.layers[1].mlp.up_proj.register_forward_pre_hook(lambda m, i: None)
    p = hf.plan(model)
    assert p.swaps["mlp"] == ("model.layers.0.mlp",)  # layer 1's MLP stays on torch, whole
    assert p.swaps["qkv"] == ("model.layers.1.self_attn",)  # layer 0's q, k and v stay apart, k_proj its own
    hf._swap(model, p)
    x = torch.randn(2, 3, TINY["hidden_size"]).to(torch.bfloat16)
    hf.reset_stats()
    hf._linear(model.model.layers[0].self_attn.k_proj, x)
    hf._linear(model.model.layers[0].self_attn.q_proj, x)
    assert seen == [torch.Size([2, 3, TINY["num_key_value_heads"] * TINY["head_dim"]])]
    assert hf.stats() == {"fallback:gemm:module": 1, "gemm": 1}


@pytest.mark.parametrize("bias", [False, True])
def test_a_patched_mlp_and_attention_hold_their_weights_once_and_keep_the_stock_state_dict(bias):
    stock = _tiny(moe=False, layers=2, attention_bias=bias)
    ours = copy.deepcopy(stock)
    hf._swap(ours, hf.plan(ours))
    mlp, attn = ours.model.layers[0].mlp, ours.model.layers[0].self_attn
    assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
    assert mlp.gate_up_weight.shape == (2 * TINY["intermediate_size"], TINY["hidden_size"])
    assert not any(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj"))
    rows = (TINY["num_attention_heads"] * TINY["head_dim"], *2 * [TINY["num_key_value_heads"] * TINY["head_dim"]])
    assert attn.qkv_weight.shape == (sum(rows), TINY["hidden_size"]) and attn.qkv_rows == rows
    assert (attn.qkv_bias is not None) == bias
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in stock.parameters())
    want, got = stock.state_dict(), ours.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    parts = [got[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert len({t.untyped_storage().data_ptr() for t in parts}) == 3  # copies: safetensors saves them
    # A stock checkpoint loads into the patched model (strictly), and the forward still matches.
    fresh = _tiny(moe=False, layers=2, attention_bias=bias)
    hf._swap(fresh, hf.plan(fresh))
    fresh.load_state_dict(want)
    ids = torch.randint(0, TINY["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(fresh(ids).logits, stock(ids).logits)


def test_experts_refusals():
    experts = _tiny(moe=True, layers=1).model.layers[0].mlp.experts.to(torch.bfloat16)
    h = torch.zeros(3, TINY["hidden_size"], dtype=torch.bfloat16)
    assert hf._experts_refusal(experts, h) == "device"
    assert hf._experts_refusal(experts, h.half()) == "dtype"
    # moe_experts takes bf16 and fp16 weights in the activations' dtype, SwiGLU, at most 512 experts
    assert hf._experts_refusal(experts, h, "moe_experts") == "device"
    assert hf._experts_refusal(experts.half(), h.half(), "moe_experts") == "device"
    assert hf._experts_refusal(experts.float(), h.float(), "moe_experts") == "dtype"
    assert hf._experts_refusal(experts.half(), h.bfloat16(), "moe_experts") == "dtype"
    experts.bfloat16().act_fn = torch.nn.GELU()
    assert hf._experts_refusal(experts, h, "moe_experts") == "activation"
    assert hf._experts_refusal(experts, h) == "device"  # grouped_mm applies the module's own activation
    experts.act_fn = torch.nn.SiLU()
    experts.num_experts = 513
    assert hf._experts_refusal(experts, h, "moe_experts") == "shape"
    experts.has_bias = True
    assert hf._experts_refusal(experts, h) == "layout"


# ---------------------------------------------------------------------------------------------
# Warm-up specs and random models


@pytest.mark.parametrize("geometry", sorted(hf.GEOMETRIES))
def test_warmup_specs_cover_the_models_kernels_in_its_dtype_and_eps(geometry):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf.model_config(geometry, 1), dtype=torch.bfloat16)
    model.config.rms_norm_eps = 1e-5
    specs = hf.warmup_specs(model)
    ops = {s.variant().op for s in specs}
    moe = geometry == "qwen3-30b-a3b"
    routing = {"moe_dispatch", "moe_combine", "moe_route"} if moe else set()
    routing |= {"grouped_gemm"} if moe and hf.EXPERTS_PATH == "moe_experts" else set()
    assert ops == {"rmsnorm", "qk_norm", "attention", "attention_decode", "gemm_leakyrelu"} | routing
    # the router's weights in the model's dtype, renormalised as the config says (both modes)
    assert {(s.weight_dtype, s.renormalize, s.mode) for s in specs if s.variant().op == "moe_route"} == (
        {("bf16", model.config.norm_topk_prob, m) for m in ("decode", "prefill")} if moe else set())
    assert ops <= set(rosekernels.KERNELS)
    gemms = {(s.activation, s.gated) for s in specs if s.variant().op == "gemm_leakyrelu"}
    assert gemms == ({("none", False)} if moe else {("none", False), ("silu", True)})  # projections, SwiGLU
    g = hf.GEOMETRIES[geometry]
    for s in specs:
        assert getattr(s, "dtype") == "bf16" and getattr(s, "weight_dtype", "bf16") == "bf16"
        if s.variant().op in ("rmsnorm", "qk_norm"):
            assert s.eps == 1e-5
    assert {s.hidden for s in specs if s.variant().op == "rmsnorm"} == {g.hidden}
    assert {(s.q_heads, s.k_heads, s.head_dim, s.rope) for s in specs if s.variant().op == "qk_norm"} == {
        (g.heads_q, g.heads_kv, g.head_dim, rope) for rope in ("none", "bf16")}  # with the rotary tables, or not
    assert {s.mode for s in specs if s.variant().op == "rmsnorm"} == {"prefill", "decode"}


def test_model_config_of_an_unknown_geometry_is_refused():
    with pytest.raises(ValueError, match="unknown geometry 'qwen3-9b'"):
        hf.model_config("qwen3-9b", 2)


def test_random_model_has_random_norm_weights_and_the_released_geometry():
    c = hf.random_model("qwen3-30b-a3b", 1, device="meta").config
    assert (c.hidden_size, c.head_dim, c.num_key_value_heads, c.num_experts, c.num_experts_per_tok) == (2048, 128, 4, 128, 8)
    a, b = (_tiny(moe=False, layers=2).model.layers[1].post_attention_layernorm.weight.float() for _ in range(2))
    assert torch.equal(a, b), "the seed decides the weights"
    assert 0.1 < a.std() < 0.3 and abs(a.mean() - 1) < 0.05


def test_q_k_and_v_fuse_only_where_one_gemm_computes_all_three():
    """Biases all or none, one weight dtype, one bias dtype: otherwise the projections stay apart (each its own
    GEMM or forward)."""
    model = _tiny(moe=False, layers=4, device="meta", attention_bias=True)
    model.model.layers[1].self_attn.v_proj.bias = None
    model.model.layers[2].self_attn.q_proj.to(torch.float16)
    model.model.layers[3].self_attn.k_proj.bias.data = model.model.layers[3].self_attn.k_proj.bias.float()
    p = hf.plan(model)
    assert p.swaps["qkv"] == ("model.layers.0.self_attn",) and len(p.swaps["attention"]) == 4
    assert "   1 x q, k and v projections -> one rosekernels.gemm" in str(p)
