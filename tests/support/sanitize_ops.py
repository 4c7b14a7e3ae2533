"""Every op once on ragged shapes, for compute-sanitizer (tests/test_sanitizer_gpu.py runs this script
under memcheck, racecheck and synccheck). Sizes are small and odd so that every kernel's edge paths
(partial tiles, masked rows, split-K reductions, swapped GEMM tiles) run; outputs are checked loosely
against torch so that a kernel that silently did nothing also fails."""
import torch

import rosekernels


def close(out, ref, what, tol=3e-2):
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()
    assert err < tol, f"{what}: relative error {err:.3g}"


def main() -> None:
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(37, 5, 128, device=dev, dtype=bf)
    k = torch.randn(37, 3, 128, device=dev, dtype=bf)
    w = torch.rand(128, device=dev, dtype=bf) + 0.5
    qn, kn = rosekernels.qk_norm(q, k, w)
    ref = q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    close(qn, ref, "qk_norm")

    x = torch.randn(19, 1000, device=dev, dtype=bf)
    r = torch.randn(19, 1000, device=dev, dtype=bf)
    wx = torch.rand(1000, device=dev, dtype=bf) + 0.5
    y, h = rosekernels.rmsnorm(x, wx, residual=r)
    hf = x.float() + r.float()
    close(y, hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * wx.float(), "rmsnorm")

    for m in (1, 7, 33, 97, 300):  # decode plain/swapped tiles (split or not), then prefill
        a = torch.randn(m, 1000, device=dev, dtype=bf)
        b = torch.randn(776, 1000, device=dev, dtype=bf) / 32
        out = rosekernels.gemm_leakyrelu(a, b, 0.1)
        close(out, torch.nn.functional.leaky_relu(a.float() @ b.float().t(), 0.1), f"gemm m={m}")

    # (S_q, S_kv, causal, d): the last takes 192-key tiles with O stored from registers (row-predicated).
    for sq, skv, causal, d in ((200, 333, True, 64), (3, 1500, False, 64), (1, 777, True, 64), (200, 8269, False, 128)):
        qa = torch.randn(2, sq, 8, d, device=dev, dtype=bf)
        ka = torch.randn(2, skv, 2, d, device=dev, dtype=bf)
        va = torch.randn(2, skv, 2, d, device=dev, dtype=bf)
        o = rosekernels.attention(qa, ka, va, causal=causal)
        ref = torch.nn.functional.scaled_dot_product_attention(
            qa.transpose(1, 2).float(), ka.transpose(1, 2).float(), va.transpose(1, 2).float(),
            is_causal=False, enable_gqa=True,
            attn_mask=torch.ones(sq, skv, dtype=torch.bool, device=dev).tril(skv - sq) if causal else None)
        close(o, ref.transpose(1, 2), f"attention {sq}x{skv}")

    # Paged decode attention with garbage block ids past each length and a sequence of length 0:
    # nothing outside the cache may be read.
    from attention_reference import check_kvcache, paged_cache
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([0, 1, 97, 300], dtype=torch.int32)
    kd = torch.randn(4, 300, 2, 128, device=dev, dtype=bf)
    vd = torch.randn(4, 300, 2, 128, device=dev, dtype=bf)
    kc, vc, table = paged_cache(kd, vd, lengths, 16, 3, g)
    qd = torch.randn(4, 2, 8, 128, device=dev, dtype=bf)
    o, lse = rosekernels.attention_with_kvcache(qd, kc, vc, lengths.to(dev), block_table=table, return_lse=True)
    check_kvcache(o, lse, qd, kc, vc, lengths, table, True, 128 ** -0.5, "paged decode")

    # Packed sequences of lengths 0, 1, 130 and 257 with spare rows past the last one: no load or
    # store may leave q, k, v or out.
    cu = torch.tensor([0, 0, 1, 131, 388], dtype=torch.int32, device=dev)
    qv = torch.randn(400, 8, 128, device=dev, dtype=bf)
    kv = torch.randn(388, 2, 128, device=dev, dtype=bf)
    o, lse = rosekernels.attention_varlen(qv, kv, kv, cu, cu, 257, 257, causal=True, return_lse=True)
    for b in range(1, 4):
        s, e = int(cu[b]), int(cu[b + 1])
        ref = torch.nn.functional.scaled_dot_product_attention(
            qv[s:e].transpose(0, 1).float()[None], kv[s:e].transpose(0, 1).float()[None],
            kv[s:e].transpose(0, 1).float()[None], is_causal=True, enable_gqa=True)
        close(o[s:e], ref[0].transpose(0, 1), f"varlen attention sequence {b}")
    # Garbage cumulative lengths (decreasing, past the tokens, overflowing): clamped, never followed.
    bad = torch.tensor([0, 2**31 - 1, -2**31, 500, 100], dtype=torch.int32, device=dev)
    rosekernels.attention_varlen(qv, kv, kv, bad, bad, 257, 257, causal=False)

    # Appends into a paged cache with garbage lengths (-2^31, 2^31 - 1, past the table) and block ids
    # (-1, num_blocks, 2^31 - 1), and into a contiguous one: written rows checked, nothing outside touched.
    from rosekernels.kernels.append_kvcache import random_case, reference
    for paged in (True, False):
        case = random_case(g, 9, 3, 2, 128, bf, paged, 16, 4)
        case[4][:2] = torch.tensor([-2**31, 2**31 - 1], dtype=torch.int32)
        want = reference(*case)
        rosekernels.append_kvcache(*case)
        for got, ref in zip(case[:2], want):
            assert torch.equal(got.cpu(), ref), f"append_kvcache paged={paged}"

    for t in (3, 300):  # decode and prefill variants
        xs = torch.randn(t, 512, device=dev, dtype=bf)
        ids = torch.stack([torch.randperm(16)[:4] for _ in range(t)]).to(dev, torch.int32)  # distinct per token
        ids[0, 1] = -1
        d = rosekernels.moe_dispatch(xs, ids, 16)
        wts = torch.rand(t, 4, device=dev)
        out = rosekernels.moe_combine(d.buffer, wts, d.slot_map)
        ref = (wts.unsqueeze(-1) * xs.float().unsqueeze(1) * (ids >= 0).unsqueeze(-1)).sum(1)
        close(out, ref, f"moe t={t}")

    # Grouped GEMMs: swapped (decode) and plain (prefill) tiles, gated with gathered rows and row scales,
    # on groups with empty experts and rows in no group; then garbage offsets and indices (decreasing,
    # negative, past the rows, extreme): clamped into the tensors, nothing outside them touched.
    from rosekernels.kernels.grouped_gemm import random_offsets, reference
    gen = torch.Generator().manual_seed(2)
    for rows, experts in ((21, 16), (700, 3)):
        xs = torch.randn(rows // 2 + 1, 264, device=dev, dtype=bf)
        wg = torch.randn(experts, 208, 264, device=dev, dtype=bf) / 16
        offsets = random_offsets(rows, experts, gen, covered=rows - 2).to(dev)
        index = torch.randint(xs.shape[0], (rows,), generator=gen, dtype=torch.int32).to(dev)
        scale = torch.rand(rows, device=dev)
        out = rosekernels.grouped_gemm(xs, wg, offsets, activation="silu", gated=True, a_index=index,
                                       row_scale=scale)
        ref, written = reference(xs, wg, offsets, activation="silu", gated=True, a_index=index, row_scale=scale)
        close(out[written.to(dev)], ref[written], f"grouped gemm rows={rows}")
        rosekernels.grouped_gemm(xs[index.long()], wg, offsets)  # the rows by TMA
        index[:3] = torch.tensor([-1, 2**31 - 1, -2**31], dtype=torch.int32)
        for bad in ([2**31 - 1] + [0] * experts, [-2**31] * experts + [2**31 - 1], [rows, -5] + [rows // 2] * experts):
            bad = torch.tensor(bad[:experts + 1], dtype=torch.int32, device=dev)
            rosekernels.grouped_gemm(xs, wg, bad, a_index=index, row_scale=scale)
            rosekernels.grouped_gemm(xs[:1].expand(rows, -1).contiguous(), wg, bad, activation="relu")

    # A routed-experts block, decode and prefill sizes, some choices not routed.
    for t in (5, 300):
        xs = torch.randn(t, 256, device=dev, dtype=bf)
        ids = torch.stack([torch.randperm(8)[:2] for _ in range(t)]).to(dev, torch.int32)
        ids[0, 1] = -1
        wts = torch.rand(t, 2, device=dev)
        out = rosekernels.moe_experts(xs, torch.randn(8, 128, 256, device=dev, dtype=bf) / 16,
                                      torch.randn(8, 256, 64, device=dev, dtype=bf) / 8, ids, wts)
        assert torch.isfinite(out).all(), f"moe_experts t={t}"
    torch.cuda.synchronize()
    print("all ops ran")


if __name__ == "__main__":
    main()
