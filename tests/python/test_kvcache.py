"""flare.flash_attn_with_kvcache on the CPU: flash_attn's decoding call over a contiguous or
paged KV cache, from NumPy and from torch.

The expectation is written here from the definition: the logical keys of each sequence (the
cached ones, then the new ones rotated), attention of the rotated queries over them by the
float64 NumPy reference (attention_ref.py, varlen form: its bottom-right alignment is decoding's
right alignment), under the tolerance rule. The new keys and values must land in the caller's
cache arrays in place; a rejected call must leave the caches untouched.
"""

import numpy as np
import pytest

import attention_ref as ref
import flare
from cuda_skip import requires_cuda


def rotate(x, cos, sin, positions, interleaved):
    """x (..., n, h, d) rotated at positions (n,) by the first 2·cos.shape[1] dims, in float32."""
    half = cos.shape[1]
    x = x.astype(np.float32)
    c = cos[positions][:, None, :].astype(np.float32)
    s = sin[positions][:, None, :].astype(np.float32)
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        x0, x1 = x[..., :half], x[..., half:2 * half]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    out = x.copy()
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = r0, r1
    else:
        out[..., :half], out[..., half:2 * half] = r0, r1
    return out


class Case:
    def __init__(self, rng, *, b=2, s_q=1, h=4, h_kv=2, d=32, lens=(5, 17), s_new=0,
                 capacity=40, block_size=0, rotary=None, dtype=np.float32):
        self.b, self.s_q, self.h, self.h_kv, self.d = b, s_q, h, h_kv, d
        self.lens, self.s_new, self.dtype, self.rotary = list(lens), s_new, dtype, rotary
        make = lambda *shape: rng.standard_normal(shape).astype(dtype)
        self.q = make(b, s_q, h, d)
        self.old_k = [make(n, h_kv, d) for n in lens]
        self.old_v = [make(n, h_kv, d) for n in lens]
        self.k_new = make(b, s_new, h_kv, d) if s_new else None
        self.v_new = make(b, s_new, h_kv, d) if s_new else None
        pos = np.arange(capacity + 4)[:, None]
        angle = pos * 10000.0 ** (-np.arange(8) / 8.0)[None, :]
        self.cos, self.sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
        self.block_size = block_size
        if block_size:
            self.max_blocks = -(-capacity // block_size)
            num_blocks = b * self.max_blocks + 2
            perm = rng.permutation(num_blocks)
            self.block_table = perm[:b * self.max_blocks].reshape(b, self.max_blocks).astype(np.int32)
            self.k_cache = np.full((num_blocks, block_size, h_kv, d), np.nan, dtype)
        else:
            self.block_table = None
            self.k_cache = np.full((b, capacity, h_kv, d), np.nan, dtype)
        self.v_cache = self.k_cache.copy()
        for i, n in enumerate(lens):
            for t in range(n):
                self.k_cache[self.slot(i, t)] = self.old_k[i][t]
                self.v_cache[self.slot(i, t)] = self.old_v[i][t]
        self.cache_seqlens = np.array(lens, np.int32)

    def slot(self, i, t):
        if self.block_size:
            return (self.block_table[i, t // self.block_size], t % self.block_size)
        return (i, t)

    def expected(self, causal, **kw):
        """Float64 truth and float32 naive over the logical keys, (o, lse) each; the keys; and the
        summed terms' magnitudes (check_close's floor)."""
        qs, ks, vs = [], [], []
        interleaved = self.rotary == "interleaved"
        for i, n in enumerate(self.lens):
            q, k, v = self.q[i], self.old_k[i], self.old_v[i]
            if self.s_new:
                k_new = self.k_new[i]
                if self.rotary:
                    k_new = rotate(k_new, self.cos, self.sin, n + np.arange(self.s_new),
                                   interleaved).astype(self.dtype)
                    q_pos = n + (np.arange(self.s_q) if causal else np.zeros(self.s_q, int))
                    q = rotate(q, self.cos, self.sin, q_pos, interleaved).astype(self.dtype)
                k = np.concatenate([k, k_new])
                v = np.concatenate([v, self.v_new[i]])
            qs.append(q), ks.append(k), vs.append(v)
        cu_q = np.arange(self.b + 1, dtype=np.int32) * self.s_q
        cu_k = np.concatenate([[0], np.cumsum([len(k) for k in ks])]).astype(np.int32)
        args = (np.concatenate(qs), np.concatenate(ks), np.concatenate(vs))
        kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
        *truth, mags = ref.attention(*args, magnitudes=True, **kw)
        naive = ref.attention(*args, compute=np.float32, round_to=self.dtype, **kw)
        to_batch = lambda o, lse: (o.reshape(self.b, self.s_q, self.h, self.d),
                                   lse.reshape(self.h, self.b, self.s_q).transpose(1, 0, 2))
        return to_batch(*truth), to_batch(*naive), np.concatenate(ks), mags

    def cache_keys(self):
        return np.concatenate([np.stack([self.k_cache[self.slot(i, t)] for t in
                                         range(n + self.s_new)]).reshape(-1, self.h_kv, self.d)
                               for i, n in enumerate(self.lens)])


def check(case, seed, out, lse, causal, **kw):
    truth, naive, keys, mags = case.expected(causal, **kw)
    tol = 2 * float(np.finfo(case.dtype).eps) * max(1.0, float(np.max(np.abs(keys))))
    np.testing.assert_allclose(case.cache_keys(), keys, rtol=0, atol=tol,
                               err_msg=f"appended keys (seed {seed})")
    ref.check_close("o", out, truth[0], naive[0], case.dtype, seed, mags["o"])
    ref.check_close("lse", lse, truth[1], naive[1], np.float32, seed, mags["lse"])


@pytest.mark.parametrize("block_size", [0, 1, 16, 7])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_decode_numpy(rng, seed, block_size, rotary, backend):
    case = Case(rng, s_q=2, s_new=2, block_size=block_size, rotary=rotary, lens=(0, 17))
    out, lse = flare.flash_attn_with_kvcache(
        case.q, case.k_cache, case.v_cache, case.k_new, case.v_new,
        rotary_cos=case.cos if rotary else None, rotary_sin=case.sin if rotary else None,
        cache_seqlens=case.cache_seqlens, block_table=case.block_table, causal=True,
        rotary_interleaved=rotary == "interleaved", return_softmax_lse=True, backend=backend)
    check(case, seed, out, lse, True)


def test_gqa_window_softcap_alibi_float16(rng, seed):
    case = Case(rng, h=8, h_kv=1, s_q=3, lens=(30, 9), dtype=np.float16, block_size=4)
    slopes = (2.0 ** -np.arange(1, 9)).astype(np.float32)
    out, lse = flare.flash_attn_with_kvcache(
        case.q, case.k_cache, case.v_cache, cache_seqlens=case.cache_seqlens,
        block_table=case.block_table, window_size=(5, 0), softcap=4.0, alibi_slopes=slopes,
        return_softmax_lse=True)
    check(case, seed, out, lse, False, window=(5, 0), softcap=4.0, alibi_slopes=slopes)


def test_scalar_and_default_seqlens_return_out_only(rng, seed):
    case = Case(rng, lens=(9, 9))
    out = flare.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=9)
    assert isinstance(out, np.ndarray) and out.shape == case.q.shape
    full = Case(np.random.default_rng(seed), lens=(40, 40))
    out_full, lse = flare.flash_attn_with_kvcache(full.q, full.k_cache, full.v_cache,
                                                  return_softmax_lse=True)
    check(full, seed, out_full, lse, False)


def test_torch_matches_numpy_and_appends_in_place(rng, seed):
    torch = pytest.importorskip("torch")
    case = Case(rng, s_q=1, s_new=1, block_size=16, rotary="halves")
    t = lambda x: None if x is None else torch.from_numpy(x.copy())
    k_cache, v_cache = t(case.k_cache), t(case.v_cache)
    out, lse = flare.flash_attn_with_kvcache(
        t(case.q), k_cache, v_cache, t(case.k_new), t(case.v_new), t(case.cos), t(case.sin),
        cache_seqlens=t(case.cache_seqlens), block_table=t(case.block_table), causal=True,
        rotary_interleaved=False, return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    out_np, lse_np = flare.flash_attn_with_kvcache(
        case.q, case.k_cache, case.v_cache, case.k_new, case.v_new, case.cos, case.sin,
        cache_seqlens=case.cache_seqlens, block_table=case.block_table, causal=True,
        rotary_interleaved=False, return_softmax_lse=True)
    np.testing.assert_array_equal(out.numpy(), out_np)
    np.testing.assert_array_equal(lse.numpy(), lse_np)
    np.testing.assert_array_equal(k_cache.numpy(), case.k_cache)  # both appended in place
    check(case, seed, out_np, lse_np, True)


def test_rejections_name_the_argument_and_leave_the_cache(rng):
    case = Case(rng, s_new=1, block_size=8)
    bad = case.block_table.copy()
    bad[1, 0] = 1000
    before = case.k_cache.copy()
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 1000"):
        flare.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, case.k_new,
                                      case.v_new, cache_seqlens=case.cache_seqlens,
                                      block_table=bad)
    np.testing.assert_array_equal(case.k_cache, before)
    with pytest.raises(ValueError, match="exceeds the cache capacity"):
        flare.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, case.k_new,
                                      case.v_new, cache_seqlens=40, block_table=case.block_table)
    with pytest.raises(ValueError, match="rotary_cos: needs k_new"):
        flare.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, rotary_cos=case.cos,
                                      rotary_sin=case.sin, cache_seqlens=case.cache_seqlens,
                                      block_table=case.block_table)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        flare.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache,
                                      cache_leftpad=case.cache_seqlens)
    with pytest.raises(TypeError, match="cache_seqlens"):
        flare.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens="5")
    np.testing.assert_array_equal(case.k_cache, before)


# ---- CUDA tensors --------------------------------------------------------------------------------
# The same calls with torch CUDA tensors (float16, which the NumPy reference can round to; the C++
# suite tests/test_gpu_kvcache.cpp covers bfloat16 and the rest): the caches after the call must
# equal those of the same call on CPU tensors bit for bit, and the outputs follow the tolerance
# rule above against the float64 reference. Skipped without torch, a CUDA device, or a flare
# build with CUDA kernels.



def _call_on(device, case, *, rotary, causal=True, num_splits=0, **kw):
    """case's call on torch tensors of `device`: (out, lse, k_cache, v_cache) as NumPy arrays."""
    import torch
    t = lambda x: None if x is None else torch.from_numpy(np.ascontiguousarray(x)).to(device)
    k_cache, v_cache = t(case.k_cache), t(case.v_cache)
    alibi = kw.pop("alibi_slopes", None)
    out, lse = flare.flash_attn_with_kvcache(
        t(case.q), k_cache, v_cache, t(case.k_new), t(case.v_new),
        rotary_cos=t(case.cos) if rotary else None, rotary_sin=t(case.sin) if rotary else None,
        cache_seqlens=t(case.cache_seqlens), block_table=t(case.block_table), causal=causal,
        rotary_interleaved=rotary == "interleaved", alibi_slopes=t(alibi), num_splits=num_splits,
        return_softmax_lse=True, **kw)
    if device == "cuda":
        assert out.is_cuda and lse.is_cuda and out.dtype == torch.float16
        torch.cuda.synchronize()
    return tuple(x.cpu().numpy() for x in (out, lse, k_cache, v_cache))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("block_size", [0, 1, 16, 7])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_cuda_decode_matches_cpu(rng, seed, rotary, block_size, num_splits):
    case = Case(rng, b=3, s_q=3, s_new=3, h=8, h_kv=2, d=64, lens=(0, 17, 36),
                block_size=block_size, rotary=rotary, dtype=np.float16)
    out, lse, k_cache, v_cache = _call_on("cuda", case, rotary=rotary, num_splits=num_splits)
    _, _, k_cpu, v_cpu = _call_on("cpu", case, rotary=rotary, num_splits=num_splits)
    np.testing.assert_array_equal(k_cache, k_cpu, err_msg=f"k_cache, CUDA vs CPU (seed {seed})")
    np.testing.assert_array_equal(v_cache, v_cpu, err_msg=f"v_cache, CUDA vs CPU (seed {seed})")
    case.k_cache, case.v_cache = k_cache, v_cache
    check(case, seed, out, lse, True)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_splits", [0, 7])
@pytest.mark.parametrize("h_kv", [1, 2])
def test_cuda_gqa_window_softcap_alibi(rng, seed, h_kv, num_splits):
    case = Case(rng, h=8, h_kv=h_kv, s_q=3, s_new=1, lens=(30, 9), d=40, dtype=np.float16,
                block_size=4)
    slopes = (2.0 ** -np.arange(1, 9)).astype(np.float32)
    kw = dict(window_size=(5, 0), softcap=4.0)
    out, lse, k_cache, v_cache = _call_on("cuda", case, rotary=None, causal=False,
                                          num_splits=num_splits, alibi_slopes=slopes, **kw)
    _, _, k_cpu, _ = _call_on("cpu", case, rotary=None, causal=False, alibi_slopes=slopes, **kw)
    np.testing.assert_array_equal(k_cache, k_cpu, err_msg=f"k_cache, CUDA vs CPU (seed {seed})")
    case.k_cache, case.v_cache = k_cache, v_cache
    check(case, seed, out, lse, False, window=(5, 0), softcap=4.0, alibi_slopes=slopes)


@pytest.mark.gpu
@requires_cuda
def test_cuda_paged_equals_contiguous_bit_for_bit(seed):
    results = []
    for block_size in (0, 1, 8):
        case = Case(np.random.default_rng(seed), s_q=2, s_new=2, lens=(3, 30), block_size=block_size,
                    rotary="halves", dtype=np.float16)
        results.append(_call_on("cuda", case, rotary="halves", num_splits=3)[:2])
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0], err_msg=f"o (seed {seed})")
        np.testing.assert_array_equal(lse, results[0][1], err_msg=f"lse (seed {seed})")
