"""Attention written out from its definition in NumPy: the ground truth of the Python tests.

    t = scale · q kᵀ;  s = softcap ? cap·tanh(t / cap) : t;  s += −slope_h · |pos_i − j|
    keys outside [pos_i − left, pos_i + right] dropped, pos_i = i + s_k − s_q (bottom-right);
    P = softmax(s);  LSE = log Σ exp(s);  O = P v;  a row that sees no key: O = 0, LSE = −inf.
    Backward with D = rowsum(dO ∘ O): dV = Pᵀ dO;  dS = P ∘ (dO vᵀ − D);
    dT = dS ∘ (1 − tanh²(t / cap)) [softcap];  dQ = scale · dT k;  dK = scale · dTᵀ q.

`compute` = numpy.float64 is the truth. `compute` = numpy.float32 with `round_to` = the input
dtype is the naive kernel of the tolerance rule (docs/architecture.md, "Tolerance rule"): scores
and softmax in float32, every sum a left-to-right loop in float32, P (and dS) rounded to the
input dtype before the products with V (and K, Q). Dropout is not modelled
here (the library's reference backend covers it).
"""

import numpy as np


def _visible(s_q, s_k, causal, window):
    left, right = window
    if causal:
        right = 0
    pos = np.arange(s_q)[:, None] + (s_k - s_q)
    j = np.arange(s_k)[None, :]
    keep = np.ones((s_q, s_k), dtype=bool)
    if right >= 0:
        keep &= j <= pos + right
    if left >= 0:
        keep &= j >= pos - left
    return keep, pos - j


def _contract(spec, a, b, sequential):
    """np.einsum with one summed index. sequential: the sum runs left to right in the operands'
    dtype, as a simple kernel's loop does (NumPy's own sums are pairwise, and so more accurate
    than any kernel a tolerance should be measured against)."""
    if not sequential:
        return np.einsum(spec, a, b)
    ins, out = spec.split("->")
    summed = [c for c in dict.fromkeys(ins.replace(",", "")) if c not in out]
    assert len(summed) == 1, spec
    products = np.einsum(f"{ins}->{out}{summed[0]}", a, b)
    return np.cumsum(products, axis=-1)[..., -1]


def _one_sequence(q, k, v, dout, *, scale, causal, window, softcap, slopes, compute, round_to):
    """q (s_q, h, d), k / v (s_k, h_kv, d) → o (s_q, h, d), lse (h, s_q), grads if dout."""
    seq = compute != np.float64
    s_q, h, d = q.shape
    s_k, h_kv = k.shape[0], k.shape[1]
    group = h // h_kv
    q, k, v = (x.astype(compute) for x in (q, k, v))
    kk = np.repeat(k, group, axis=1)  # (s_k, h, d)
    vv = np.repeat(v, group, axis=1)
    t = _contract("qhd,khd->hqk", q, kk, seq) * compute(scale)
    s = softcap * np.tanh(t / softcap) if softcap > 0 else t
    keep, dist = _visible(s_q, s_k, causal, window)
    if slopes is not None:
        s = s - slopes.astype(compute)[:, None, None] * np.abs(dist)[None]
    s = np.where(keep[None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True) if s_k else np.full((h, s_q, 1), -np.inf, compute)
    m_safe = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m_safe)
    den = np.cumsum(e, axis=-1)[..., -1:] if seq and s_k else np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(den > 0, e / np.where(den > 0, den, 1), 0).astype(compute)
        lse = np.where(den[..., 0] > 0, np.log(np.where(den > 0, den, 1))[..., 0] + m_safe[..., 0],
                       -np.inf)
    p_mm = p.astype(round_to).astype(compute) if round_to is not None else p
    o = _contract("hqk,khd->qhd", p_mm, vv, seq)
    # Magnitudes of the summed terms (|a|·|b| instead of a·b): the scale of the rounding noise
    # of any order of summation, even where the terms cancel to a result near 0.
    # A score s carries a rounding error of one ulp of |s| (and the row max m one of |m|), which
    # exp(s − m) turns into a relative error of P: the factor `grow` below.
    s_abs = np.where(keep[None], np.abs(np.where(keep[None], s, 0)), 0)
    grow = 1 + s_abs + np.abs(m_safe)
    # The LSE is fp32 whatever the inputs, and dLSE/ds = p: its noise is p-weighted score noise.
    # A computed score is a sum of d products, so its rounding noise scales with the summed terms,
    # scale·Σ|q||k| (plus the ALiBi bias), which exceeds |s| wherever the products cancel — a
    # d=40 score near 0 from terms of magnitude ~4, say. (softcap's tanh has slope ≤ 1.)
    t_terms = np.einsum("qhd,khd->hqk", np.abs(q).astype(np.float64),
                        np.abs(kk).astype(np.float64)) * scale
    if slopes is not None:
        t_terms = t_terms + np.abs(slopes.astype(np.float64))[:, None, None] * np.abs(dist)[None]
    s_terms = np.where(keep[None], t_terms, 0)
    mags = {"o": np.einsum("hqk,khd->qhd", p * grow, np.abs(vv)),
            "lse": np.abs(m_safe[..., 0]) + np.abs(lse - m_safe[..., 0]) + np.sum(p * s_terms, -1)}
    if dout is None:
        return o, lse, None, mags
    do = dout.astype(compute)
    o_out = o.astype(round_to).astype(compute) if round_to is not None else o
    big_d = _contract("qhd,qhd->hq", do, o_out, seq)[..., None]
    dvv = _contract("hqk,qhd->khd", p_mm, do, seq)
    dp = _contract("qhd,khd->hqk", do, vv, seq)
    ds = p * (dp - big_d)
    if softcap > 0:
        ds = ds * (1 - np.tanh(t / softcap) ** 2)
    ds_mm = ds.astype(round_to).astype(compute) if round_to is not None else ds
    dq = _contract("hqk,khd->qhd", ds_mm, kk, seq) * compute(scale)
    dkk = _contract("hqk,qhd->khd", ds_mm, q, seq) * compute(scale)
    dk = dkk.reshape(s_k, h_kv, group, d).sum(axis=2)
    dv = dvv.reshape(s_k, h_kv, group, d).sum(axis=2)
    dp_mag = np.einsum("qhd,khd->hqk", np.abs(do), np.abs(vv))
    d_mag = np.einsum("qhd,qhd->hq", np.abs(do), np.abs(o_out))[..., None]
    ds_mag = p * grow * (dp_mag + d_mag)
    if softcap > 0:
        ds_mag = ds_mag * (1 - np.tanh(t / softcap) ** 2)
    mags["dq"] = np.einsum("hqk,khd->qhd", ds_mag, np.abs(kk)) * scale
    mags["dk"] = (np.einsum("hqk,qhd->khd", ds_mag, np.abs(q)) * scale).reshape(
        s_k, h_kv, group, d).sum(axis=2)
    mags["dv"] = np.einsum("hqk,qhd->khd", p * grow, np.abs(do)).reshape(
        s_k, h_kv, group, d).sum(axis=2)
    return o, lse, (dq, dk, dv), mags


def attention(q, k, v, dout=None, *, softmax_scale=None, causal=False, window=(-1, -1),
              softcap=0.0, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
              compute=np.float64, round_to=None, magnitudes=False):
    """Fixed length: q (b, s_q, h, d) → o like q, lse (b, h, s_q); varlen (cu_seqlens given):
    q (total_q, h, d) → o like q, lse (h, total_q). With dout, also (dq, dk, dv). With
    magnitudes, also a dict of the largest summed-term magnitude per output (for check_close).
    Results are in `compute`."""
    d = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / np.sqrt(d)
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, compute=compute,
              round_to=round_to)

    def slopes_of(b):
        if alibi_slopes is None:
            return None
        return alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]

    if cu_seqlens_q is None:
        pieces = [(slice(i, i + 1), slice(i, i + 1), i) for i in range(q.shape[0])]
        squeeze = True
    else:
        pieces = [(slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])),
                   slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])), i)
                  for i in range(len(cu_seqlens_q) - 1)]
        squeeze = False
    o = np.zeros(q.shape, compute)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]) if squeeze else (q.shape[1], q.shape[0]),
                  -np.inf, compute)
    grads = tuple(np.zeros(x.shape, compute) for x in (q, k, v))
    mags = {n: 0.0 for n in ("o", "lse", "dq", "dk", "dv")}
    for sq, sk, i in pieces:
        if sq.stop == sq.start:
            continue
        take = (lambda x, s_: x[s_.start]) if squeeze else (lambda x, s_: x[s_])
        r = _one_sequence(take(q, sq), take(k, sk), take(v, sk),
                          None if dout is None else take(dout, sq), slopes=slopes_of(i), **kw)
        if squeeze:
            o[i], lse[i] = r[0], r[1]
        else:
            o[sq], lse[:, sq] = r[0], r[1]
        if dout is not None:
            for g, x, s_ in zip(grads, r[2], (sq, sk, sk)):
                g[s_.start if squeeze else s_] = x
        for n, m in r[3].items():
            fin = np.isfinite(m)
            if fin.any():
                mags[n] = max(mags[n], float(np.max(m[fin])))
    result = (o, lse) if dout is None else (o, lse, grads)
    return result + (mags,) if magnitudes else result


def dtype_eps(dtype):
    return float(np.finfo(dtype).eps)


def check_close(name, got, truth, naive, dtype, seed, magnitude=None):
    """The tolerance rule (docs/architecture.md): max|got − truth| ≤ 2·max|naive − truth| +
    floor, where floor is the rounding noise of `dtype` (one eps) at the magnitude of the summed
    terms (`magnitude`, from attention(magnitudes=True); by default the truth's own). −inf
    entries (rows that see no key) must match exactly."""
    got = np.asarray(got, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    naive = np.asarray(naive, dtype=np.float64)
    assert got.shape == truth.shape, f"{name}: shape {got.shape} != {truth.shape} (seed {seed})"
    inf = np.isinf(truth)
    assert np.array_equal(np.isinf(got), inf) and np.array_equal(got[inf], truth[inf]), \
        f"{name}: infinite entries differ from the reference (seed {seed})"
    assert not np.isnan(got).any(), f"{name}: NaN in output (seed {seed})"
    fin = ~inf
    if not fin.any():
        return
    err = np.max(np.abs(got[fin] - truth[fin]))
    naive_err = np.max(np.abs(naive[fin] - truth[fin]))
    if magnitude is None:
        magnitude = float(np.max(np.abs(truth[fin])))
    floor = dtype_eps(dtype) * magnitude
    budget = 2 * naive_err + floor
    assert err <= budget, (f"{name}: max error {err:.3g} exceeds 2·naive {naive_err:.3g} + floor "
                           f"{floor:.3g} (dtype {np.dtype(dtype).name}, seed {seed})")
