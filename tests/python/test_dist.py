"""flare.dist on the CPU: in-process ranks (threads of this interpreter) run ring_flash_attn_func
end to end, forward and backward, against single-device flare and the float64 reference under
the tolerance rule (attention_ref.check_close); the plain (NumPy) road; the sequence layout
helpers; communicators; and a clear TypeError / ValueError naming the argument for bad input.
The torch tests are skipped without torch; the NCCL road is test_dist_gpu.py's.
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import attention_ref as ref
import flare
import flare.dist as fd

TIMEOUT = 60.0  # seconds a correct run never waits for


def run_ranks(comms, fn):
    """fn(rank, comm) on one thread per rank; returns the results, re-raising a rank's error."""
    results, errors = [None] * len(comms), [None] * len(comms)

    def body(r):
        try:
            results[r] = fn(r, comms[r])
        except BaseException as e:  # noqa: BLE001 — handed to the main thread
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"rank {r} failed: {type(e).__name__}: {e}") from e
    return results


def heads_for(strategy, world):
    """GQA 2:1; all-to-all hands out whole heads, so as many K/V heads as ranks."""
    return (2 * world, world) if strategy == "a2a" else (4, 2)


# ---- the torch autograd function --------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["zigzag", "ring", "a2a"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_ring_flash_attn_matches_single_device(world, strategy, causal, dtype, seed):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    b, s, d = 2, 5 * world + 3, 16  # not divisible by the ranks: uneven shards
    h, hk = heads_for(strategy, world)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(tdt)
                     for shape in ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)))
    softcap = 4.0 if dtype == "float32" else 0.0  # half the grid with a softcap
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)

    def rank_fn(r, comm):
        local = [fd.shard_sequence(x, r, world, strategy=strategy).requires_grad_()
                 for x in (q, k, v)]
        out, lse, none = fd.ring_flash_attn_func(*local, causal=causal, group=comm,
                                                 strategy=strategy, seqlen=s, softcap=softcap,
                                                 return_attn_probs=True)
        assert none is None and lse.dtype == torch.float32 and lse.shape == (b, h, out.shape[1])
        out.backward(fd.shard_sequence(dout, r, world, strategy=strategy))
        return out.detach(), lse, local[0].grad, local[1].grad, local[2].grad

    per_rank = run_ranks(comms, rank_fn)
    out, dq, dk, dv = (fd.unshard_sequence([x[i] for x in per_rank], strategy=strategy)
                       for i in (0, 2, 3, 4))
    lse = fd.unshard_sequence([x[1] for x in per_rank], strategy=strategy, dim=2)

    # Single-device flare on the whole sequence, and the float64 truth with the naive kernel
    # in the input precision that sets the budget.
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    single, single_lse, _ = flare.flash_attn_func(qs, ks, vs, causal=causal, softcap=softcap,
                                                  return_attn_probs=True)
    single.backward(dout)
    npd = np.dtype(dtype)
    arrays = [x.numpy() for x in (q, k, v, dout)]
    kw = dict(causal=causal, softcap=softcap)
    truth_o, truth_lse, truth_g, mags = ref.attention(*arrays, magnitudes=True, **kw)
    naive_o, naive_lse, naive_g = ref.attention(*arrays, compute=np.float32, round_to=npd, **kw)
    for label, got in (("context-parallel", (out, lse, dq, dk, dv)),
                       ("single-device", (single.detach(), single_lse, qs.grad, ks.grad,
                                          vs.grad))):
        for name, g, t, n, dt in zip(("o", "lse", "dq", "dk", "dv"), got,
                                     (truth_o, truth_lse) + truth_g,
                                     (naive_o, naive_lse) + naive_g,
                                     (npd, np.float32, npd, npd, npd)):
            assert g.dtype == (torch.float32 if name == "lse" else tdt), (label, name)
            ref.check_close(f"{label} {name}", g.float().numpy(), t, n, dt, seed, mags[name])


def test_seqlen_defaults_to_local_rows_times_ranks(seed):
    torch = pytest.importorskip("torch")
    world, b, s, h, d = 2, 1, 12, 2, 8
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=gen) for _ in range(3))
    expected = flare.flash_attn_func(q, k, v, causal=True)
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)
    outs = run_ranks(comms, lambda r, c: fd.zigzag_ring_flash_attn_func(
        *(fd.zigzag_shard(x, r, world) for x in (q, k, v)), causal=True, group=c))
    torch.testing.assert_close(fd.zigzag_unshard(outs), expected, rtol=1e-5, atol=1e-6)

    # Uneven rows without seqlen=: every rank is told to pass it.
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)
    s = 11
    errors = [None] * world

    def uneven(r, comm):
        with pytest.raises(ValueError, match=r"^seqlen: .* pass seqlen=") as e:
            fd.ring_flash_attn_func(*(fd.zigzag_shard(x[:, :s], r, world) for x in (q, k, v)),
                                    group=comm)
        errors[r] = str(e.value)

    run_ranks(comms, uneven)
    assert all("disagree on seqlen" in e for e in errors), errors


def test_without_grad_and_plan_cache(seed):
    torch = pytest.importorskip("torch")
    world, b, s, h, d = 2, 1, 8, 2, 8
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=gen) for _ in range(3))
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)

    def rank_fn(r, comm):
        local = [fd.zigzag_shard(x, r, world) for x in (q, k, v)]
        first = fd.ring_flash_attn_func(*local, group=comm)
        again = fd.ring_flash_attn_func(*local, group=comm)
        assert not first.requires_grad
        assert len(comm._plans) == 1  # the same shape and options reuse one plan
        fd.ring_flash_attn_func(*local, group=comm, causal=True)
        assert len(comm._plans) == 2
        return first, again

    for first, again in run_ranks(comms, rank_fn):
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    for comm in comms:
        comm.close()
        assert comm.closed and not comm._plans


def test_missing_rank_fails_within_the_timeout():
    torch = pytest.importorskip("torch")
    comms = fd.Communicator.in_process_group(2, timeout=0.3)
    q = torch.randn(1, 4, 2, 8)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1"):
        fd.ring_flash_attn_func(q, q, q, group=comms[0])  # rank 1 never calls
    assert time.monotonic() - start < 10.0
    with pytest.raises(RuntimeError, match=r"rank 1"):
        comms[0].health()  # the communicator stays failed


# ---- bad input --------------------------------------------------------------------------------

def one_rank():
    return fd.Communicator.in_process_group(1, timeout=TIMEOUT)[0]


def bad_ring_calls(torch):
    q = torch.randn(1, 6, 2, 8)
    comm = one_rank()
    good = dict(q=q, k=q, v=q, group=comm)
    return [
        ("q", dict(good, q=None), TypeError),
        ("q", dict(good, q=q.numpy()), TypeError),
        ("k", dict(good, k=[1.0]), TypeError),
        ("q", dict(good, q=q[0]), ValueError),
        ("v", dict(good, v=q[None]), ValueError),
        ("group", dict(good, group="world"), TypeError),
        ("group", dict(good, group=None), ValueError),  # CPU tensors need a flare communicator
        ("strategy", dict(good, strategy="stripe"), ValueError),
        ("strategy", dict(good, strategy=1), TypeError),
        ("causal", dict(good, causal="yes"), TypeError),
        ("softmax_scale", dict(good, softmax_scale="0.1"), TypeError),
        ("softmax_scale", dict(good, softmax_scale=0.0), ValueError),
        ("window_size", dict(good, window_size=3), ValueError),
        ("softcap", dict(good, softcap=None), TypeError),
        ("deterministic", dict(good, deterministic=[1]), TypeError),
        ("return_attn_probs", dict(good, return_attn_probs="no"), TypeError),
        ("seqlen", dict(good, seqlen=2.5), TypeError),
        ("seqlen", dict(good, seqlen=0), ValueError),
        ("dropout_p", dict(good, dropout_p="0"), TypeError),
        ("dropout_p", dict(good, dropout_p=0.1), NotImplementedError),
        ("alibi_slopes", dict(good, alibi_slopes=torch.ones(2)), NotImplementedError),
        ("q", dict(good, q=q.double()), ValueError),          # the library names the dtype
        ("k", dict(good, k=q[:, :5]), ValueError),            # local rows disagree with the plan
    ]


@pytest.mark.parametrize("case", range(23))
def test_ring_flash_attn_bad_arguments(case):
    torch = pytest.importorskip("torch")
    calls = bad_ring_calls(torch)
    assert len(calls) == 23
    name, kwargs, exc = calls[case]
    with pytest.raises(exc, match=rf"^{name}: "):
        fd.ring_flash_attn_func(**kwargs)


def test_communicator_bad_arguments_and_state():
    with pytest.raises(ValueError, match=r"^world_size: "):
        fd.Communicator.in_process_group(0)
    with pytest.raises(TypeError, match=r"^world_size: "):
        fd.Communicator.in_process_group(2.0)
    with pytest.raises(TypeError, match=r"^timeout: "):
        fd.Communicator.in_process_group(2, timeout="1s")
    with pytest.raises(ValueError, match=r"^timeout: "):
        fd.Communicator.in_process_group(2, timeout=-1)
    with pytest.raises(TypeError, match=r"^Communicator: "):
        fd.Communicator(3)
    with pytest.raises(TypeError, match=r"^nccl_id: "):
        fd.Communicator.from_nccl_id("id", 0, 1, 0)
    with pytest.raises(ValueError, match=r"^device: "):
        fd.Communicator.from_nccl_id(bytes(128), 0, 1, "cpu")
    with pytest.raises(TypeError, match=r"^take_ownership: "):
        fd.Communicator.adopt_nccl(1234, take_ownership="yes")
    with pytest.raises(TypeError, match=r"^comm: "):
        fd.ContextParallelAttention(None, batch=1, seqlen=4, heads_q=1, heads_kv=1,
                                    head_dim=8, dtype="float32")
    import datetime
    comms = fd.Communicator.in_process_group(3, timeout=datetime.timedelta(seconds=2))
    for r, c in enumerate(comms):
        assert (c.rank, c.world_size, c.device, c.kind, c.timeout) == (r, 3, "cpu",
                                                                       "in-process", 2.0)
        assert "rank %d of 3" % r in repr(c)
    run_ranks(comms, lambda r, c: c.barrier())
    comms[0].health()
    comms[0].close()
    with pytest.raises(ValueError, match=r"^comm: the communicator is closed"):
        comms[0].barrier()


def test_nccl_entry_points_without_nccl():
    if fd.nccl_built():
        pytest.skip("this build has NCCL: test_dist_gpu.py covers it")
    for call in (fd.nccl_unique_id, fd.Communicator.from_env,
                 lambda: fd.Communicator.from_nccl_id(bytes(128), 0, 2, 0),
                 lambda: fd.Communicator.adopt_nccl(1234)):
        with pytest.raises(NotImplementedError, match=r"^NCCL communicator: .*no NCCL"):
            call()
    with pytest.raises(ValueError, match=r"^nccl_id: expected 128 bytes"):
        fd.Communicator.from_nccl_id(bytes(16), 0, 2, 0)


# ---- the plain road (NumPy) -------------------------------------------------------------------

def test_numpy_forward_backward(rng, seed):
    world, b, s, h, hk, d = 3, 2, 14, 4, 2, 16
    q, dout = (rng.standard_normal((b, s, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, s, hk, d)).astype(np.float32) for _ in range(2))
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)

    def rank_fn(r, comm):
        cp = fd.ContextParallelAttention(comm, batch=b, seqlen=s, heads_q=h, heads_kv=hk,
                                         head_dim=d, dtype=np.float32, causal=True)
        local = [fd.zigzag_shard(x, r, world) for x in (q, k, v, dout)]
        assert cp.local_seqlen == local[0].shape[1]
        assert [(g, n) for g, _, n in cp.chunks] == [(g, n) for g, _, n in
                                                      fd._ext.sequence_shard(1, s, world, r)]
        cp.set_timing(True)
        out, lse = cp.forward(*local[:3])
        grads = cp.backward(local[3], *local[:3], out, lse)
        timing = cp.take_timing()
        assert timing["calls"] == 2 and timing["bytes_sent"] > 0
        return (out, lse) + tuple(grads)

    per_rank = run_ranks(comms, rank_fn)
    got = [fd.zigzag_unshard([x[i] for x in per_rank], dim=2 if i == 1 else 1) for i in range(5)]
    truth_o, truth_lse, truth_g, mags = ref.attention(q, k, v, dout, causal=True, magnitudes=True)
    naive_o, naive_lse, naive_g = ref.attention(q, k, v, dout, causal=True, compute=np.float32,
                                                round_to=np.float32)
    for name, g, t, n in zip(("o", "lse", "dq", "dk", "dv"), got, (truth_o, truth_lse) + truth_g,
                             (naive_o, naive_lse) + naive_g):
        ref.check_close(name, g, t, n, np.float32, seed, mags[name])


# ---- packed batches (every sequence split across the ranks on its own) -------------------------

# Uneven and empty sequences, and one shorter than the chunk count of 3 ranks.
PACK = [0, 5, 5, 19, 20, 33]


@pytest.mark.parametrize("strategy", ["zigzag", "ring", "a2a"])
def test_numpy_packed_forward_backward(strategy, rng, seed):
    world, d = 3, 16
    h, hk = heads_for(strategy, world)
    total = PACK[-1]
    q, dout = (rng.standard_normal((total, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((total, hk, d)).astype(np.float32) for _ in range(2))
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)

    def rank_fn(r, comm):
        cp = fd.ContextParallelAttention(comm, cu_seqlens=np.array(PACK, np.int32), heads_q=h,
                                         heads_kv=hk, head_dim=d, dtype=np.float32, causal=True,
                                         strategy=strategy, softcap=4.0)
        local = [fd.shard_varlen(x, PACK, r, world, strategy=strategy) for x in (q, k, v, dout)]
        assert cp.local_cu_seqlens == fd.varlen_local_cu_seqlens(PACK, r, world,
                                                                 strategy=strategy)
        assert cp.local_seqlen == local[0].shape[0] == cp.local_cu_seqlens[-1]
        out, lse = cp.forward(*local[:3])
        assert lse.shape == (h, local[0].shape[0])
        return (out, lse) + tuple(cp.backward(local[3], *local[:3], out, lse))

    per_rank = run_ranks(comms, rank_fn)
    got = [fd.unshard_varlen([x[i] for x in per_rank], PACK, strategy=strategy,
                             dim=1 if i == 1 else 0) for i in range(5)]
    kw = dict(causal=True, softcap=4.0, cu_seqlens_q=PACK, cu_seqlens_k=PACK)
    truth_o, truth_lse, truth_g, mags = ref.attention(q, k, v, dout, magnitudes=True, **kw)
    naive_o, naive_lse, naive_g = ref.attention(q, k, v, dout, compute=np.float32,
                                                round_to=np.float32, **kw)
    for name, g, t, n in zip(("o", "lse", "dq", "dk", "dv"), got, (truth_o, truth_lse) + truth_g,
                             (naive_o, naive_lse) + naive_g):
        ref.check_close(name, g, t, n, np.float32, seed, mags[name])


@pytest.mark.parametrize("strategy", ["zigzag", "ring", "a2a"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_varlen_is_each_sequence_sharded(strategy, world, rng):
    # Each rank's pack is shard_sequence of every sequence on its own, in batch order; and
    # unshard_varlen puts the packs back.
    for cu in ([0, 0], [0, 7], PACK, [0, 1, 1, 2, 40]):
        x = rng.standard_normal((cu[-1], 3, 4))
        lse = rng.standard_normal((3, cu[-1]))
        shards, lses = [], []
        for r in range(world):
            shards.append(fd.shard_varlen(x, cu, r, world, strategy=strategy))
            lses.append(fd.shard_varlen(lse, cu, r, world, strategy=strategy, dim=1))
            per_sequence = [fd.shard_sequence(x[None, a:b], r, world, strategy=strategy)[0]
                            for a, b in zip(cu, cu[1:])]
            np.testing.assert_array_equal(shards[-1], np.concatenate(per_sequence))
            local_cu = fd.varlen_local_cu_seqlens(cu, r, world, strategy=strategy)
            assert local_cu == [0] + list(np.cumsum([p.shape[0] for p in per_sequence]))
        np.testing.assert_array_equal(fd.unshard_varlen(shards, cu, strategy=strategy), x)
        np.testing.assert_array_equal(fd.unshard_varlen(lses, cu, strategy=strategy, dim=1), lse)


@pytest.mark.parametrize("strategy", ["zigzag", "ring"])
def test_ring_flash_attn_varlen_matches_single_device(strategy, seed):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    world, h, hk, d = 3, 4, 2, 16
    total = PACK[-1]
    q, k, v, dout = (torch.randn(shape, generator=gen)
                     for shape in ((total, h, d), (total, hk, d), (total, hk, d), (total, h, d)))
    comms = fd.Communicator.in_process_group(world, timeout=TIMEOUT)

    def rank_fn(r, comm):
        local = [fd.shard_varlen(x, PACK, r, world, strategy=strategy).requires_grad_()
                 for x in (q, k, v)]
        out, lse, none = fd.ring_flash_attn_varlen_func(
            *local, torch.tensor(PACK, dtype=torch.int32), max(np.diff(PACK)), causal=True,
            group=comm, strategy=strategy, return_attn_probs=True)
        assert none is None and lse.shape == (h, out.shape[0])
        out.backward(fd.shard_varlen(dout, PACK, r, world, strategy=strategy))
        return out.detach(), lse, local[0].grad, local[1].grad, local[2].grad

    per_rank = run_ranks(comms, rank_fn)
    got = [fd.unshard_varlen([x[i] for x in per_rank], PACK, strategy=strategy,
                             dim=1 if i == 1 else 0) for i in range(5)]
    arrays = [x.numpy() for x in (q, k, v, dout)]
    kw = dict(causal=True, cu_seqlens_q=PACK, cu_seqlens_k=PACK)
    truth_o, truth_lse, truth_g, mags = ref.attention(*arrays, magnitudes=True, **kw)
    naive_o, naive_lse, naive_g = ref.attention(*arrays, compute=np.float32, round_to=np.float32,
                                                **kw)
    for name, g, t, n in zip(("o", "lse", "dq", "dk", "dv"), got, (truth_o, truth_lse) + truth_g,
                             (naive_o, naive_lse) + naive_g):
        ref.check_close(name, g.numpy(), t, n, np.float32, seed, mags[name])


def test_packed_bad_arguments():
    comm = fd.Communicator.in_process_group(1, timeout=TIMEOUT)[0]
    common = dict(heads_q=2, heads_kv=2, head_dim=8, dtype=np.float32)
    with pytest.raises(ValueError, match=r"^batch: a packed plan"):
        fd.ContextParallelAttention(comm, batch=2, cu_seqlens=[0, 3, 4], **common)
    with pytest.raises(TypeError, match=r"^cu_seqlens: "):
        fd.ContextParallelAttention(comm, cu_seqlens=[0, 3.0], **common)
    with pytest.raises(TypeError, match=r"^cu_seqlens: "):
        fd.shard_varlen(np.zeros((4, 1)), "0,4", 0, 1)
    with pytest.raises(ValueError, match=r"^cu_seqlens: must start at 0"):
        fd.shard_varlen(np.zeros((4, 1)), [0, 3, 2, 4], 0, 1)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected batch"):
        fd.varlen_local_cu_seqlens([0], 0, 1)
    with pytest.raises(ValueError, match=r"^x: 4 rows .* ends at 5"):
        fd.shard_varlen(np.zeros((4, 1)), [0, 5], 0, 1)
    with pytest.raises(ValueError, match=r"^shards\[1\]: "):
        fd.unshard_varlen([np.zeros((2, 1)), np.zeros((3, 1))], [0, 4], strategy="ring")
    with pytest.raises(ValueError, match=r"^local_cu_seqlens: "):
        _ = fd.ContextParallelAttention(comm, batch=1, seqlen=4, **common).local_cu_seqlens
    with pytest.raises(ValueError, match=r"^batch: "):
        fd.ContextParallelAttention(comm, **common)  # neither a batch nor cu_seqlens


def test_ring_flash_attn_varlen_bad_arguments():
    torch = pytest.importorskip("torch")
    comm = fd.Communicator.in_process_group(1, timeout=TIMEOUT)[0]
    q = torch.zeros(6, 2, 8)
    cases = [
        (ValueError, r"^q: expected 3 dimensions", (q[None], q, q, [0, 6]), {}),
        (ValueError, r"^max_seqlen: ", (q, q, q, [0, 6], -1), {}),
        (NotImplementedError, r"^dropout_p: ", (q, q, q, [0, 6], None, 0.1), {}),
        (NotImplementedError, r"^alibi_slopes: ", (q, q, q, [0, 6]),
         {"alibi_slopes": torch.ones(2)}),
        (ValueError, r"^cu_seqlens: must start at 0", (q, q, q, [1, 6]), {}),
        (TypeError, r"^group: ", (q, q, q, [0, 6]), {"group": 3}),
    ]
    for error, pattern, args, kwargs in cases:
        with pytest.raises(error, match=pattern):
            fd.ring_flash_attn_varlen_func(*args, **{"group": comm, **kwargs})


# ---- sequence layout helpers ------------------------------------------------------------------

def test_zigzag_layout_rows():
    x = np.arange(8)[None, :, None]
    assert fd.zigzag_shard(x, 0, 2)[0, :, 0].tolist() == [0, 1, 6, 7]
    assert fd.zigzag_shard(x, 1, 2)[0, :, 0].tolist() == [2, 3, 4, 5]
    assert fd.shard_sequence(x, 1, 2, strategy="ring")[0, :, 0].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("strategy", ["zigzag", "ring", "a2a"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_unshard_round_trip(strategy, world, rng):
    for s in (0, 5, 37):
        x = rng.standard_normal((2, s, 3, 4))
        shards = [fd.shard_sequence(x, r, world, strategy=strategy) for r in range(world)]
        assert sum(p.shape[1] for p in shards) == s
        np.testing.assert_array_equal(fd.unshard_sequence(shards, strategy=strategy), x)
        lse = rng.standard_normal((2, 3, s))
        parts = [fd.shard_sequence(lse, r, world, strategy=strategy, dim=2) for r in range(world)]
        np.testing.assert_array_equal(fd.unshard_sequence(parts, strategy=strategy, dim=-1), lse)


def test_torch_shard_is_differentiable():
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 10, 2, 3, requires_grad=True)
    shards = [fd.zigzag_shard(x, r, 3) for r in range(3)]
    (fd.zigzag_unshard(shards) * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0), rtol=0, atol=0)


def test_layout_helpers_bad_arguments():
    x = np.zeros((1, 6, 2, 3))
    with pytest.raises(TypeError, match=r"^x: "):
        fd.zigzag_shard([[1.0]], 0, 2)
    with pytest.raises(ValueError, match=r"^rank: "):
        fd.zigzag_shard(x, 2, 2)
    with pytest.raises(ValueError, match=r"^world_size: "):
        fd.zigzag_shard(x, 0, 0)
    with pytest.raises(ValueError, match=r"^dim: "):
        fd.zigzag_shard(x, 0, 2, dim=4)
    with pytest.raises(ValueError, match=r"^strategy: "):
        fd.shard_sequence(x, 0, 2, strategy="stripe")
    with pytest.raises(TypeError, match=r"^shards: "):
        fd.zigzag_unshard([])
    with pytest.raises(TypeError, match=r"^shards\[1\]: "):
        fd.zigzag_unshard([x, None])
    with pytest.raises(ValueError, match=r"^shards\[0\]: 4 rows .* holds 3"):
        fd.zigzag_unshard([x[:, :4], x[:, :2]])


def test_import_does_not_need_torch():
    # flare.dist's torch parts load on first use: with torch kept out, the plain road and the
    # layout helpers still import and run.
    code = ("import sys, numpy as np, flare.dist as fd; "
            "assert 'torch' not in sys.modules; "
            "print(fd.zigzag_shard(np.arange(4)[None], 1, 2).tolist())")
    env = dict(os.environ, FLARE_NO_TORCH="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[1, 2]]"
