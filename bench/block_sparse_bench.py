"""block_sparse_bench.py — block-sparse attention on one GPU: time against the mask's density.

Each cell is one (s, pass, causal) at bf16, b 1, d 128, 16 query heads (and a GQA 32/8 cell),
with random 128×128 block masks at densities 100 % (every block on: the dense kernels' work),
50, 25, 10 and 5 % (fixed seed, one mask per head, the diagonal block always on so that no row
is empty). The measure of a sparse kernel is how close its time comes to density × the time of
the same call with every block on: `ratio_to_ideal` = time / (density × full time), 1.0 being
cost exactly proportional to the blocks computed (the goal is ≤ 1.15). "density" is the share
of the blocks the call computes (after the causal mask, which removes blocks too), and "tflops"
counts only the FLOPs of those blocks. The dense call without a mask ("flare-dense") is timed
beside the all-on mask to show what the mask's reads cost.

  python3 bench/block_sparse_bench.py --out out.json [--quick]
"""
import argparse
import json

from bench_common import QUEUED_METHOD, import_torch_and_flare, queued_times_ms, result_header

DENSITIES = [1.0, 0.5, 0.25, 0.1, 0.05]
BLOCK = 128


def random_mask(torch, h, blocks, density, causal, seed):
    """(1, h, blocks, blocks) uint8: each block on with probability `density`, the diagonal on;
    under a causal mask the blocks above the diagonal are off (the kernels never visit them)."""
    g = torch.Generator().manual_seed(seed)
    on = torch.rand(1, h, blocks, blocks, generator=g) < density
    on |= torch.eye(blocks, dtype=torch.bool)
    if causal:
        on &= torch.ones(blocks, blocks, dtype=torch.bool).tril()
    return on.to(torch.uint8)


def computed_share(mask, causal):
    """Blocks computed / blocks a dense call computes (the lower triangle when causal; the
    diagonal blocks count in full, as the kernels compute them)."""
    blocks = mask.shape[-1]
    full = blocks * (blocks + 1) // 2 if causal else blocks * blocks
    return mask.sum(dim=(-1, -2)).float().mean().item() / full


def measure(torch, flare, s, h, h_kv, causal, iters, spin):
    d, dt = 128, torch.bfloat16
    blocks = s // BLOCK
    g = torch.Generator(device="cuda").manual_seed(s + h)
    q = torch.randn(1, s, h, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(1, s, h_kv, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(1, s, h_kv, d, device="cuda", dtype=dt, generator=g)
    dout = torch.randn_like(q)
    out, lse = torch.empty_like(q), torch.empty(1, h, s, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ops = torch.ops.flare
    rows, full_us = [], {}
    # The operators' trailing arguments (python/flare/_torch.py's _OPTIONS): no varlen, dropout,
    # window, softcap or ALiBi.
    options = (None, None, s, s, 0.0, d ** -0.5, causal, -1, -1, 0.0, None, False, None,
               flare._core.backend_code("auto"))

    def time_us(step):
        return sorted(queued_times_ms(torch, step, 3, iters, spin))[iters // 2] * 1e3

    for density in ["dense"] + DENSITIES:
        mask = None if density == "dense" else random_mask(torch, h, blocks, density, causal,
                                                          seed=1000 + int(density * 100)).cuda()
        for pass_ in ("fwd", "bwd"):
            if mask is None:
                def fwd():
                    ops.fwd(q, k, v, out, lse, *options)

                def bwd():
                    ops.bwd(dout, q, k, v, out, lse, dq, dk, dv, *options)
            else:
                def fwd():
                    ops.block_sparse_fwd(q, k, v, out, lse, mask, BLOCK, BLOCK, *options)

                def bwd():
                    ops.block_sparse_bwd(dout, q, k, v, out, lse, dq, dk, dv, mask, BLOCK, BLOCK,
                                         *options)
            fwd()  # out and lse for the backward
            us = time_us(fwd if pass_ == "fwd" else bwd)
            share = 1.0 if mask is None else computed_share(mask, causal)
            if density == 1.0:
                full_us[pass_] = us
            flops = 4 * s * s * h * d * (0.5 if causal else 1.0) * share
            flops *= 2.5 if pass_ == "bwd" else 1.0
            rows.append({
                "impl": "flare-dense" if mask is None else "flare", "pass": pass_,
                "dtype": "bfloat16", "b": 1, "s": s, "h": h, "h_kv": h_kv, "d": d,
                "causal": causal, "block": BLOCK, "density": round(share, 4), "us": us,
                "tflops": flops / us * 1e-6,
                "ratio_to_ideal": us / (share * full_us[pass_]) if pass_ in full_us else None,
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="s 4k only (a smoke run)")
    ap.add_argument("--long", action="store_true", help="add s 64k (about a minute more)")
    args = ap.parse_args()
    torch, flare = import_torch_and_flare("block_sparse_bench.py", 0)
    spin = 100_000_000
    cells = [(4096, 16, 16, False)] if args.quick else [
        (16384, 16, 16, False), (16384, 16, 16, True), (16384, 32, 8, True)]
    if args.long:
        cells += [(65536, 16, 16, False), (65536, 16, 16, True)]
    rows = []
    for s, h, h_kv, causal in cells:
        rows += measure(torch, flare, s, h, h_kv, causal, args.iters, spin)
    sparse = [r for r in rows if r["ratio_to_ideal"] is not None and r["density"] < 0.99]
    result = {
        **result_header(torch, flare, QUEUED_METHOD + "; ratio_to_ideal = time / (density x "
                        "time with every block on)"),
        "worst_ratio_to_ideal": max((r["ratio_to_ideal"] for r in sparse), default=None),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"worst time / (density x full time) over {len(sparse)} sparse rows: "
          f"{result['worst_ratio_to_ideal']}")


if __name__ == "__main__":
    main()
