"""decode_bench.py — KV-cache decoding on one GPU: flare.flash_attn_with_kvcache against PyTorch SDPA.

Each cell is one decoding step, s_q = 1 over a cache of s_cache tokens per sequence (bf16, d 128,
32 query heads over h_kv kv heads), with the cache contiguous or paged. flare reads the cache in
place; the peer is torch.nn.functional.scaled_dot_product_attention over the same contiguous
cache (enable_gqa for h_kv < h; the backend torch picks, named in the row). Decoding is bound by
memory bandwidth, so each row also gives the K/V bytes read per second and that rate as a fraction
of the card's peak (--peak-tbps; by default from the card's name: H100 SXM 3.35 TB/s, H100 PCIe
2.0, H200 4.8).

  python3 bench/decode_bench.py --json out.json [--quick]
"""
import argparse
import json
import math

from bench_common import QUEUED_METHOD, import_torch_and_flare, queued_times_ms, result_header

# (batch, s_cache): from one long sequence to many short ones; the cache stays under ~9 GiB.
# Memory bandwidth (TB/s) by a substring of the card's name, the first that matches.
PEAK_TBPS = (("H100 PCIe", 2.0), ("H100", 3.35), ("H200", 4.8))

CELLS = [(1, 1024), (1, 8192), (1, 32768), (1, 131072), (8, 8192), (32, 4096), (64, 2048),
         (128, 1024), (16, 32768)]
QUICK = [(1, 8192), (32, 4096)]


def sdpa_backend_name(torch, q, k, v, gqa):
    """The SDPA backend torch runs for these inputs (the first that accepts them)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            return backend
        except RuntimeError:
            continue
    return None


def measure(torch, flare, b, s_cache, h, h_kv, d, paged, block_size, iters, spin):
    dt = torch.bfloat16
    dev = "cuda"
    q = torch.randn(b, 1, h, d, device=dev, dtype=dt)
    k = torch.randn(b, s_cache, h_kv, d, device=dev, dtype=dt)
    v = torch.randn(b, s_cache, h_kv, d, device=dev, dtype=dt)
    seqlens = torch.full((b,), s_cache, device=dev, dtype=torch.int32)
    rows = []
    if paged:
        blocks = b * s_cache // block_size
        perm = torch.randperm(blocks, device=dev)  # pages scattered over the pool
        k_pages = torch.empty(blocks, block_size, h_kv, d, device=dev, dtype=dt)
        v_pages = torch.empty_like(k_pages)
        k_pages[perm] = k.reshape(blocks, block_size, h_kv, d)
        v_pages[perm] = v.reshape(blocks, block_size, h_kv, d)
        table = perm.reshape(b, s_cache // block_size).to(torch.int32)

        def flare_step():
            flare.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                          block_table=table)
        out = flare.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                            block_table=table)
    else:
        def flare_step():
            flare.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
        out = flare.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)

    # The peer over the contiguous cache, (b, heads, s, d) views.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = h_kv != h
    backend = sdpa_backend_name(torch, qt, kt, vt, gqa)
    from torch.nn.attention import sdpa_kernel

    def torch_step():
        with sdpa_kernel([backend]):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    with sdpa_kernel([backend]):
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=gqa)
    max_diff = (out.float() - ref.transpose(1, 2).float()).abs().max().item()

    kv_bytes = 2 * b * s_cache * h_kv * d * q.element_size()
    for impl, step in (("flare", flare_step), ("torch-sdpa", torch_step)):
        times = sorted(queued_times_ms(torch, step, 5, iters, spin))
        ms = times[len(times) // 2]
        rows.append({"impl": impl, "pass": "fwd", "dtype": "bfloat16", "b": b, "s_q": 1,
                     "s_cache": s_cache, "h": h, "h_kv": h_kv, "d": d, "paged": paged,
                     "block_size": block_size if paged else None, "ms": ms,
                     "kv_gbps": kv_bytes / ms / 1e6,
                     "sdpa_backend": str(backend).split(".")[-1] if impl != "flare" else None,
                     "max_abs_diff_vs_sdpa": max_diff})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="two cells (CI-sized smoke run)")
    ap.add_argument("--peak-tbps", type=float, default=None,
                    help="the card's memory bandwidth (default: by its name, PEAK_TBPS)")
    args = ap.parse_args()
    torch, flare = import_torch_and_flare("decode_bench.py", 0)
    if args.peak_tbps is None:
        name = torch.cuda.get_device_name()
        known = [tbps for key, tbps in PEAK_TBPS if key in name]
        if not known:
            ap.error(f"--peak-tbps: no bandwidth known for '{name}'; give the card's in TB/s")
        args.peak_tbps = known[0]
    spin = 200_000_000  # ~0.1 s of GPU spin: the host queues every call behind it
    rows = []
    for b, s_cache in (QUICK if args.quick else CELLS):
        for h_kv in (8, 32):
            if b * s_cache * h_kv * 128 * 2 * 2 > 9 * 2**30:
                continue
            for paged, block_size in ((False, 0), (True, 256), (True, 16)):
                if paged and block_size == 16 and (b, s_cache) not in ((1, 32768), (32, 4096)):
                    continue
                for row in measure(torch, flare, b, s_cache, 32, h_kv, 128, paged, block_size,
                                   args.iters, spin):
                    row["frac_peak"] = row["kv_gbps"] / (args.peak_tbps * 1e3)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    # flare / torch per cell (same cache, same call).
    ratios = []
    for r in rows:
        if r["impl"] == "flare":
            peer = [t for t in rows if t["impl"] == "torch-sdpa" and all(
                t[k] == r[k] for k in ("b", "s_cache", "h_kv", "paged", "block_size"))]
            if peer:
                ratios.append(peer[0]["ms"] / r["ms"])
    result = {
        **result_header(torch, flare,
                        QUEUED_METHOD + "; kv_gbps = K and V bytes of the cache / time"),
        "peak_tbps": args.peak_tbps,
        "speedup_vs_torch_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios))
        if ratios else None,
        "rows": rows,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"flare / torch-sdpa (geomean of {len(ratios)} cells): "
          f"{result['speedup_vs_torch_geomean']}")


if __name__ == "__main__":
    main()
