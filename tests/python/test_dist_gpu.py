"""flare.dist on GPUs: one process per GPU (torch.multiprocessing spawn), torch.distributed's
NCCL group initialised over a local TCP store, flare's NCCL communicator built from it (the
unique id broadcast through the group) or from the launch environment; ring_flash_attn_func's
forward and backward against single-GPU flare on the whole sequence, both under the tolerance
rule against a float64 reference. Skipped without torch, a CUDA build of flare with NCCL, or two
CUDA devices.
"""

import os
import socket

import pytest

torch = pytest.importorskip("torch")
import flare  # noqa: E402
import flare.dist as fd  # noqa: E402

pytestmark = pytest.mark.gpu


def _skip_reason():
    if not flare.cuda_built():
        return "this build of flare has no CUDA kernels"
    if not fd.nccl_built():
        return "this build of flare has no NCCL communicator"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs at least 2 CUDA devices"
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return "torch.distributed with NCCL is not available"
    return None


if _skip_reason() is not None:
    pytest.skip(_skip_reason(), allow_module_level=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(q, k, v, causal, dtype):
    """The definition in torch ops, every step in `dtype`: float64 is the truth, the inputs'
    dtype the naive kernel that sets the budget (as test_torch.py's references)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def within_budget(name, got, truth, naive, dtype):
    err = (got.double() - truth).abs().max().item()
    naive_err = (naive.double() - truth).abs().max().item()
    floor = torch.finfo(dtype).eps * truth.abs().max().item()
    assert err <= 2 * naive_err + floor, \
        f"{name}: max error {err:.3g} > 2·naive {naive_err:.3g} + floor {floor:.3g}"


def grads(fn, inputs, dout):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in inputs]


def _worker(rank, world, port, env_port, strategy, causal, results):
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
    env_comm = None
    try:
        dev = torch.device("cuda", rank)
        gen = torch.Generator().manual_seed(1234)  # every rank makes the same global problem
        b, s, h, hk, d = 1, 1000 * world + 37, 2 * world, world, 64
        dt = torch.bfloat16
        q, k, v, dout = (torch.randn(shape, generator=gen).to(dt).to(dev)
                         for shape in ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)))
        single = grads(lambda *x: flare.flash_attn_func(*x, causal=causal), (q, k, v), dout)
        truth = grads(lambda *x: reference(*x, causal, torch.float64), (q, k, v), dout)
        naive = grads(lambda *x: reference(*x, causal, dt), (q, k, v), dout)

        def shard(x):
            return fd.shard_sequence(x, rank, world, strategy=strategy)

        # Two roads to a communicator: the torch group (the id broadcast through it), and the
        # launch environment with no torch.distributed involved (its own rendezvous port).
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(env_port))
        env_comm = fd.Communicator.from_env(timeout=120)
        roads = {"process group": None, "from_env": env_comm}
        for road, group in roads.items():
            got = grads(lambda *x: fd.ring_flash_attn_func(*x, causal=causal, group=group,
                                                           strategy=strategy, seqlen=s),
                        [shard(x) for x in (q, k, v)], shard(dout))
            for name, g, one, t, n in zip(("out", "dq", "dk", "dv"), got, single, truth, naive):
                label = f"rank {rank} {road} {strategy} causal={causal} {name}"
                within_budget(label + " (context-parallel)", g, shard(t), shard(n), dt)
                within_budget(label + " (single GPU)", shard(one), shard(t), shard(n), dt)
        torch.cuda.synchronize()
        results[rank] = "ok"
    except BaseException as e:  # noqa: BLE001 — reported by the parent
        results[rank] = f"{type(e).__name__}: {e}"
    finally:
        if env_comm is not None:
            env_comm.close()
        fd.release_process_group_communicators()
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("strategy", ["zigzag", "ring", "a2a"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_flash_attn_over_nccl(strategy, causal):
    world = 2
    manager = torch.multiprocessing.get_context("spawn").Manager()
    results = manager.dict()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on shared machines
    torch.multiprocessing.spawn(_worker, args=(world, free_port(), free_port(), strategy, causal,
                                               results), nprocs=world, join=True)
    assert dict(results) == {r: "ok" for r in range(world)}, dict(results)
