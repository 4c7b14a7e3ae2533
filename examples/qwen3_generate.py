"""Generate with a Qwen3 / Qwen3-MoE model running on rosekernels (random weights: nothing is downloaded).

    python examples/qwen3_generate.py [--model qwen3-8b|qwen3-30b-a3b] [--layers 4] [--batch 1]
                                      [--prompt 512] [--new 128] [--stock]

Builds the model from the released geometry with --layers decoder layers, compiles and loads the kernels
it needs (SIP-tuned cubins and tuned configs included), patches it with rosekernels.hf.apply, runs greedy
generate() and prints decode tokens/s; --stock runs stock transformers on the same weights first, for
comparison. Needs transformers (pip install 'rosekernels[hf]') and an H100/H200 (without one it exits
with rosekernels.device.NO_GPU_EXIT, 3).
"""
import argparse
import copy
import time

import torch

import rosekernels.hf as hf
from rosekernels import device


def generate_rate(model, ids, new):
    """(decode tokens/s, tokens): greedy generate of `new` tokens, timed against a 1-token generate
    (the prefill) so that the rate covers the decode steps only."""
    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    run(2)  # first calls: kernel plans, cuBLAS handles
    prefill, _ = run(1)
    total, out = run(new)
    return ids.shape[0] * (new - 1) / (total - prefill), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(hf.GEOMETRIES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=128, help="tokens to generate per sequence")
    ap.add_argument("--stock", action="store_true", help="also run stock transformers on the same weights")
    args = ap.parse_args()
    if args.new < 2:
        ap.error("--new must be at least 2 (the rate is of the decode steps after the first token)")
    device.require_gpu("qwen3_generate.py")

    model = hf.random_model(args.model, args.layers, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    model.generation_config.eos_token_id = None  # generate exactly --new tokens
    stock = copy.deepcopy(model) if args.stock else None
    print(hf.warmup(model))
    print(hf.plan(model))
    hf.apply(model)
    with torch.inference_mode():
        if stock is not None:
            rate, want = generate_rate(stock, ids, args.new)
            print(f"stock transformers: {rate:,.0f} decode tokens/s")
            del stock
        hf.reset_stats()
        rate, got = generate_rate(model, ids, args.new)
    print(f"rosekernels:        {rate:,.0f} decode tokens/s  ({args.model}, {args.layers} layers, "
          f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens)")
    if args.stock:
        same = (got == want).float().mean().item()
        print(f"tokens equal to stock's: {same:.1%} (random weights: near-tied logits can flip)")
    print(f"rosekernels calls: {hf.stats()}")


if __name__ == "__main__":
    main()
