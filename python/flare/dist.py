"""flare.dist: context parallelism from Python. One sequence is split across ranks (GPUs, or
threads on the CPU) and attention is computed as if it were on one device.

    import torch.distributed as dist
    from flare.dist import ring_flash_attn_func, zigzag_shard

    dist.init_process_group("nccl")                       # torchrun / mpirun launch
    q = zigzag_shard(q_full, rank, world_size)            # this rank's rows, (b, s/n, h, d)
    out = ring_flash_attn_func(q, k, v, causal=True)      # group=None: the default group

ring_flash_attn_func takes ring-flash-attn's arguments (q, k, v, dropout_p, softmax_scale,
causal, window_size, alibi_slopes, deterministic, return_attn_probs, group) over rank-local
shards and differentiates through flare's context-parallel backward. `strategy` picks the
layout the shards are in: "zigzag" (default: rank r holds chunks r and 2n-1-r of 2n, so causal
work is balanced), "ring" (rank r holds the r-th of n contiguous chunks) or "a2a" (ring layout,
head-parallel all-to-all inside). shard_sequence / zigzag_shard cut a full tensor into a rank's
rows in the matching layout; unshard_sequence / zigzag_unshard put every rank's rows back.

`group` is where the ranks talk:
  - a torch.distributed process group (None: the default group). flare builds its own NCCL
    communicator from it once, by broadcasting NCCL's 128-byte unique id through the group, and
    caches it per (group, device). The tensors must be CUDA tensors.
  - a flare.dist.Communicator: Communicator.from_env() (torchrun / mpirun variables, no
    torch.distributed needed), Communicator.from_nccl_id(...), Communicator.adopt_nccl(...), or
    Communicator.in_process_group(n), whose n ranks are threads of this process working on CPU
    tensors (for tests, and for trying the layer without GPUs).

Every rank must make the same calls in the same order (as with NCCL). Each communicator
operation has a timeout: a rank that dies or never joins makes the others fail with a
RuntimeError naming it, never hang. The extension does not link torch: tensors cross into flare
as views (their data pointers, shapes and strides), as in the rest of the package.
"""

import datetime
import numbers
import threading

from . import _core, _ext

_STRATEGIES = {"ring": 0, "zigzag": 1, "a2a": 2, "all-to-all": 2}

# Plans (each holds workspace sized for one shape) kept per communicator; the least recently
# used goes first. Every rank makes the same calls, so every rank evicts the same plan.
_PLAN_CACHE_SIZE = 8


def nccl_built():
    """True when this build of flare has the NCCL communicator (CUDA and NCCL found)."""
    return _ext.nccl_built()


def nccl_unique_id():
    """A new NCCL unique id (128 bytes) for Communicator.from_nccl_id; rank 0 makes it and every
    rank needs the same bytes."""
    return _ext.nccl_unique_id()


def launch_info():
    """Where this process sits in a launch, from torchrun's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or mpirun's (OMPI_COMM_WORLD_*): a dict with rank, size,
    local_rank, master_addr, master_port and source ("torchrun" or "mpirun")."""
    return _ext.launch_info_from_env()


def strategy_code(strategy):
    """"ring" | "zigzag" | "a2a" (or "all-to-all") → the C ABI's code."""
    if not isinstance(strategy, str):
        raise TypeError(f"strategy: expected one of {sorted(_STRATEGIES)}, got "
                        f"{_core.describe(strategy)}")
    try:
        return _STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"strategy: {strategy!r} is not one of {sorted(_STRATEGIES)}") from None


def _timeout_ms(timeout):
    """None → 0 (the library's default, 5 minutes); seconds (a real number) or a timedelta → ms."""
    if timeout is None:
        return 0
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout: expected seconds (a number) or a datetime.timedelta, got "
                        f"{_core.describe(timeout)}")
    ms = round(seconds * 1000.0)
    if not 1 <= ms <= _core._INT32_MAX:
        raise ValueError(f"timeout: {seconds} s must be at least 1 ms and at most "
                         f"{_core._INT32_MAX} ms")
    return ms


def _int_arg(value, name, low):
    return _core.integer(value, name, low, _core._INT32_MAX)


# ---- communicators ---------------------------------------------------------------------------

class Communicator:
    """One rank of a group: NCCL over GPUs, or in-process (threads of this process, host memory).

    Make one with a class method (from_env, from_nccl_id, adopt_nccl, from_process_group,
    in_process_group). A communicator is used by one thread at a time; close() releases it (or
    let it be collected). After a rank times out, the communicator stays failed: health() raises
    the error and every later call raises it too.
    """

    def __init__(self, handle, launch=None):
        if not isinstance(handle, _ext.Comm):
            raise TypeError("Communicator: use one of its class methods (from_env, "
                            "from_nccl_id, adopt_nccl, from_process_group, in_process_group)")
        self._handle = handle
        self._info = handle.info()
        self.launch = launch  # from_env's launch_info(), else None
        self._plans = {}      # plan cache: key → _ext.Plan, oldest first
        self._lock = threading.Lock()

    # -- construction --

    @classmethod
    def in_process_group(cls, world_size, *, timeout=None):
        """`world_size` communicators of one in-process group; element r is rank r's, meant for
        its own thread (tensors on the CPU)."""
        world_size = _int_arg(world_size, "world_size", 1)
        return [cls(h) for h in _ext.in_process_group(world_size, _timeout_ms(timeout))]

    @classmethod
    def from_nccl_id(cls, nccl_id, rank, world_size, device, *, timeout=None):
        """Rank `rank` of `world_size` on CUDA device `device` (an index, or a torch.device),
        from the id rank 0 made with nccl_unique_id(). Collective: every rank calls it."""
        if not isinstance(nccl_id, (bytes, bytearray)):
            raise TypeError(f"nccl_id: expected bytes, got {_core.describe(nccl_id)}")
        rank = _int_arg(rank, "rank", 0)
        world_size = _int_arg(world_size, "world_size", 1)
        device = _device_index(device)
        return cls(_ext.nccl_comm(bytes(nccl_id), rank, world_size, device,
                                  _timeout_ms(timeout)))

    @classmethod
    def from_env(cls, *, timeout=None):
        """The launcher's path, without torch.distributed: reads RANK / WORLD_SIZE / LOCAL_RANK /
        MASTER_ADDR / MASTER_PORT (torchrun) or OMPI_COMM_WORLD_* (mpirun), shares rank 0's NCCL
        id over TCP at MASTER_ADDR:MASTER_PORT and creates the communicator on CUDA device
        LOCAL_RANK. The launch info is kept in .launch."""
        handle, info = _ext.nccl_comm_from_env(_timeout_ms(timeout))
        return cls(handle, launch=info)

    @classmethod
    def adopt_nccl(cls, nccl_comm, *, take_ownership=False, timeout=None):
        """Wraps a ncclComm_t made elsewhere (its address as an int). With take_ownership it is
        destroyed with this object. A timeout aborts it: do not use it after a failure."""
        nccl_comm = _core.integer(nccl_comm, "nccl_comm", 0, _core._UINT64)
        take_ownership = _core.flag(take_ownership, "take_ownership")
        return cls(_ext.adopt_nccl_comm(nccl_comm, take_ownership, _timeout_ms(timeout)))

    @classmethod
    def from_process_group(cls, group=None, *, device=None, timeout=None):
        """flare's NCCL communicator for a torch.distributed process group (None: the default
        group), on CUDA device `device` (default: torch.cuda.current_device()). Made once per
        (group, device) by broadcasting NCCL's unique id through the group, then cached;
        collective on the first call."""
        return _process_group_communicator(group, device, timeout)

    # -- properties --

    @property
    def rank(self):
        return self._info["rank"]

    @property
    def world_size(self):
        return self._info["size"]

    @property
    def device(self):
        """"cpu" or "cuda:<index>": where this communicator's tensors live."""
        i = self._info
        return "cpu" if i["device"] == "cpu" else f"cuda:{i['device_index']}"

    @property
    def kind(self):
        """"in-process" or "nccl"."""
        return self._info["kind"]

    @property
    def timeout(self):
        """Seconds every operation may wait for a peer."""
        return self._info["timeout_ms"] / 1000.0

    @property
    def closed(self):
        return self._handle.closed

    def __repr__(self):
        state = "closed" if self.closed else self.device
        return (f"flare.dist.Communicator({self.kind}, rank {self.rank} of {self.world_size}, "
                f"{state})")

    # -- operations --

    def barrier(self):
        """Waits until every rank arrives (and this rank's earlier work completes)."""
        self._handle.barrier()

    def health(self):
        """Raises the error that made this communicator unusable, if any."""
        self._handle.health()

    def close(self):
        """Releases the plans and the communicator. Later calls raise ValueError."""
        with self._lock:
            for plan in self._plans.values():
                plan.close()
            self._plans.clear()
        self._handle.close()

    def _plan(self, key):
        """The cached plan for `key` (plan arguments after the communicator), made on a miss.
        Making one is collective: every rank misses together because every rank makes the same
        calls."""
        with self._lock:
            plan = self._plans.pop(key, None)
            if plan is None:
                plan = _ext.plan(self._handle, *key)
                if len(self._plans) >= _PLAN_CACHE_SIZE:
                    oldest = next(iter(self._plans))
                    self._plans.pop(oldest).close()
            self._plans[key] = plan  # most recently used last
            return plan


def _device_index(device):
    """A CUDA device as an index: an int, a torch.device('cuda', i), or "cuda:i"."""
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        return _int_arg(device, "device", 0)
    text = str(device)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device: expected a CUDA device index or 'cuda:<index>', got {device!r}")


# (group, device index) → Communicator. Groups are kept alive by the key, as torch keeps them.
_GROUP_COMMS = {}
_GROUP_LOCK = threading.Lock()


def _process_group_communicator(group, device, timeout):
    import torch
    import torch.distributed as tdist
    if not (tdist.is_available() and tdist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first, or pass a "
                         "flare.dist.Communicator (from_env, in_process_group)")
    pg = tdist.group.WORLD if group is None else group
    if not isinstance(pg, tdist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup, a "
                        f"flare.dist.Communicator or None, got {_core.describe(group)}")
    if not _ext.nccl_built():
        raise NotImplementedError("group: this build of flare has no NCCL communicator (it needs "
                                  "CUDA and NCCL at build time)")
    index = torch.cuda.current_device() if device is None else _device_index(device)
    key = (pg, index)
    with _GROUP_LOCK:
        comm = _GROUP_COMMS.get(key)
        if comm is not None and not comm.closed:
            return comm
        rank, size = tdist.get_rank(pg), tdist.get_world_size(pg)
        nccl_id = _ext.nccl_unique_id() if rank == 0 else bytes(128)
        # The id travels through the group itself: a CUDA tensor for an NCCL-only group, a CPU one
        # for gloo (or a group with both backends).
        where = f"cuda:{index}" if tdist.get_backend(pg) == "nccl" else "cpu"
        buf = torch.frombuffer(bytearray(nccl_id), dtype=torch.uint8).to(where)
        src = 0 if pg is tdist.group.WORLD else tdist.get_global_rank(pg, 0)
        tdist.broadcast(buf, src=src, group=pg)
        nccl_id = bytes(buf.cpu().numpy().tobytes())
        comm = Communicator.from_nccl_id(nccl_id, rank, size, index, timeout=timeout)
        _GROUP_COMMS[key] = comm
        return comm


def release_process_group_communicators():
    """Closes the communicators from_process_group cached (call it before
    torch.distributed.destroy_process_group, or to rebuild them after a failure)."""
    with _GROUP_LOCK:
        comms = list(_GROUP_COMMS.values())
        _GROUP_COMMS.clear()
    for comm in comms:
        if not comm.closed:
            comm.close()


# ---- context-parallel attention, any DLPack framework ------------------------------------------

_DTYPES = {"float32": _ext.FLOAT32, "float16": _ext.FLOAT16, "bfloat16": _ext.BFLOAT16}


def _dtype_code(dtype):
    """"float32" | "float16" | "bfloat16" (or fp32 / fp16 / bf16), a torch dtype or a NumPy
    dtype → the C ABI's code."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.split(".", 1)[0] == "torch":
        name = str(dtype)[len("torch."):]
    else:
        try:
            name = _core._numpy().dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of float32, float16, bfloat16")
    return _DTYPES[name]


class ContextParallelAttention:
    """One rank's share of attention over a sequence of `seqlen` rows split across `comm`'s ranks,
    forward and backward without autograd, for any DLPack framework (torch, NumPy, CuPy).

    Creating it is collective (every rank, same arguments; checked across ranks). Local tensors:
    q, out (b, s_local, heads_q, d); k, v (b, s_local, heads_kv, d); softmax_lse float32
    (b, heads_q, s_local), the rows in .chunks' order. With cu_seqlens (the global pack's offsets,
    host ints, batch + 1 of them; batch and seqlen are then left out) the batch is packed: every
    sequence is split across the ranks on its own (shard_varlen), and the local tensors are this
    rank's pack, q, out (local rows, heads_q, d), k, v (local rows, heads_kv, d), softmax_lse
    (heads_q, local rows). ring_flash_attn_func and ring_flash_attn_varlen_func are the torch
    autograd roads over the same plans.
    """

    def __init__(self, comm, *, heads_q, heads_kv, head_dim, dtype, batch=None, seqlen=None,
                 cu_seqlens=None, strategy="zigzag", causal=False, softmax_scale=None,
                 window_size=(-1, -1), softcap=0.0, deterministic=False, backend="auto"):
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm: expected a flare.dist.Communicator, got "
                            f"{_core.describe(comm)}")
        self.comm = comm
        self._plan = comm._plan(plan_key(
            strategy=strategy, batch=batch, seqlen=seqlen, heads_q=heads_q, heads_kv=heads_kv,
            head_dim=head_dim, dtype=_dtype_code(dtype), causal=causal,
            softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            deterministic=deterministic, backend=backend, cu_seqlens=cu_seqlens))
        # A packed plan's layout at this rank (_varlen_chunks): fixed for the plan's life.
        self._varlen = None if cu_seqlens is None else _varlen_chunks(
            strategy_code(strategy), _host_offsets(cu_seqlens), comm.world_size, comm.rank)

    @property
    def chunks(self):
        """This rank's rows: [(global_begin, local_begin, length), ...] in local order (packed:
        rows of the global pack and of this rank's pack, sequence by sequence)."""
        if self._varlen is not None:
            return list(self._varlen[0])
        return [tuple(c) for c in self._plan.shard()]

    @property
    def local_cu_seqlens(self):
        """A packed plan's local offsets: sequence i at local rows [c[i], c[i + 1])."""
        if self._varlen is None:
            raise ValueError("local_cu_seqlens: this plan is not packed (made without cu_seqlens)")
        return list(self._varlen[1])

    @property
    def local_seqlen(self):
        return sum(c[2] for c in self.chunks)

    def forward(self, q, k, v, *, stream=None):
        """Returns (out, softmax_lse) of this rank's rows."""
        group = _core.check_arrays((("q", q), ("k", k), ("v", v)))
        return _forward(self._plan, _core._Frame(group, q, _core.stream_value(stream)), q, k, v)

    def backward(self, dout, q, k, v, out, softmax_lse, *, stream=None):
        """Returns (dq, dk, dv) of this rank's rows, given the forward's out and softmax_lse."""
        group = _core.check_arrays((("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                                    ("softmax_lse", softmax_lse)))
        return _backward(self._plan, _core._Frame(group, q, _core.stream_value(stream)),
                         dout, q, k, v, out, softmax_lse)

    def set_timing(self, on=True):
        """Records where later calls' time goes (CUDA events; costs a little)."""
        self._plan.set_timing(_core.flag(on, "on"))

    def take_timing(self):
        """Sums since the last read: calls, exchanges, bytes_sent, comm_ms, compute_ms."""
        return self._plan.take_timing()


def plan_key(*, strategy, batch, seqlen, heads_q, heads_kv, head_dim, dtype, causal,
             softmax_scale, window_size, softcap, deterministic, backend, cu_seqlens=None):
    """The arguments of _ext.plan after the communicator, checked (each bad one raises TypeError
    or ValueError naming it); also the plan cache's key. A packed plan (cu_seqlens) takes its
    batch and length from the offsets: batch and seqlen must be None."""
    options = _core.Options(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                            softcap=softcap, dropout_p=0.0, deterministic=deterministic,
                            backend=backend)
    if cu_seqlens is None:
        cu = ()
        for name, value in (("batch", batch), ("seqlen", seqlen)):
            if value is None:
                raise ValueError(f"{name}: required for a fixed-length plan (or pass cu_seqlens "
                                 f"for a packed one)")
        batch = _int_arg(batch, "batch", 1)
        seqlen = _core.integer(seqlen, "seqlen", 1, (1 << 62))
    else:
        cu = _host_offsets(cu_seqlens)
        for name, value in (("batch", batch), ("seqlen", seqlen)):
            if value is not None:
                raise ValueError(f"{name}: a packed plan takes it from cu_seqlens; pass None")
        batch = seqlen = 0
    return (strategy_code(strategy), batch, seqlen, _int_arg(heads_q, "heads_q", 1),
            _int_arg(heads_kv, "heads_kv", 1), _int_arg(head_dim, "head_dim", 1), dtype,
            options.softmax_scale, options.causal, options.window_left, options.window_right,
            options.softcap, options.deterministic, options.backend, cu)


def _forward(plan, frame, q, k, v):
    q, k, v = frame.prepare(q), frame.prepare(k), frame.prepare(v)
    out = frame.empty(q.shape, q.dtype)
    lse = frame.empty(_core.lse_shape(q, len(q.shape) == 3), frame.float32())  # 3-D: packed
    with frame.device_guard():
        plan.forward(q, k, v, out, lse, frame.stream)
    return out, lse


def _backward(plan, frame, dout, q, k, v, out, lse):
    dout, q, k, v, out, lse = (frame.prepare(t) for t in (dout, q, k, v, out, lse))
    dq, dk, dv = (frame.empty(t.shape, t.dtype) for t in (q, k, v))
    with frame.device_guard():
        plan.backward(dout, q, k, v, out, lse, dq, dk, dv, frame.stream)
    return dq, dk, dv


# ---- torch: the autograd function ----------------------------------------------------------------

def _resolve_group(group, q):
    """The flare Communicator for `group` and q's device."""
    if isinstance(group, Communicator):
        return group
    if not q.is_cuda:
        raise ValueError(
            f"group: a torch.distributed group gives an NCCL communicator, which takes CUDA "
            f"tensors, and q is on {q.device.type}; on the CPU pass group= a rank of "
            f"flare.dist.Communicator.in_process_group(n) (ranks as threads)")
    return _process_group_communicator(group, q.device.index, None)


def _local_shapes(q, k, v, packed=False):
    import torch
    dims, layout = (3, "(local rows, heads, head_dim)") if packed else (
        4, "(batch, local seqlen, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {_core.describe(t)}")
        if t.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dimensions {layout}, got shape "
                             f"{tuple(t.shape)}")


def _check_unsupported(group, dropout_p, alibi_slopes):
    """The arguments context parallelism refuses, each named."""
    if group is not None and not isinstance(group, Communicator):
        import torch.distributed as tdist
        if not (tdist.is_available() and isinstance(group, tdist.ProcessGroup)):
            raise TypeError(f"group: expected a torch.distributed ProcessGroup, a "
                            f"flare.dist.Communicator or None, got {_core.describe(group)}")
    if _core.real(dropout_p, "dropout_p") != 0.0:
        raise NotImplementedError("dropout_p: dropout is not supported by context parallelism "
                                  "yet; pass 0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not supported by context parallelism "
                                  "yet; pass None")


def _attend(q, k, v, plan, return_attn_probs):
    """The autograd road when a gradient is wanted, else the forward alone."""
    import torch
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = RingFlashAttention.function().apply(q, k, v, plan)
    else:
        out, lse = _forward(plan, _core._Frame("torch", q, None), q, k, v)
    return (out, lse, None) if return_attn_probs else out


class RingFlashAttention:
    """Holder of the torch.autograd.Function, defined on first use so that importing flare.dist
    does not import torch."""

    _function = None

    @classmethod
    def function(cls):
        if cls._function is None:
            import torch

            class _RingFlashAttnFunc(torch.autograd.Function):
                @staticmethod
                def forward(ctx, q, k, v, plan):
                    frame = _core._Frame("torch", q, None)
                    out, lse = _forward(plan, frame, q, k, v)
                    ctx.save_for_backward(q, k, v, out, lse)
                    ctx.plan = plan
                    ctx.mark_non_differentiable(lse)
                    return out, lse

                @staticmethod
                def backward(ctx, dout, dlse):
                    q, k, v, out, lse = ctx.saved_tensors
                    frame = _core._Frame("torch", q, None)
                    dq, dk, dv = _backward(ctx.plan, frame, dout, q, k, v, out, lse)
                    return dq, dk, dv, None

            cls._function = _RingFlashAttnFunc
        return cls._function


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                         return_attn_probs=False, group=None, *, strategy="zigzag",
                         seqlen=None, softcap=0.0):
    """Context-parallel attention over rank-local torch tensors, with autograd.

    q (batch, s_local, nheads, headdim), k / v (batch, s_local, nheads_k, headdim): this rank's
    rows of one global sequence, in `strategy`'s layout ("zigzag": zigzag_shard's; "ring" and
    "a2a": shard_sequence(..., strategy="ring")'s). `seqlen` is the global length: by default
    s_local · world_size (pass it when the length is not a multiple of the ranks, so that ranks
    hold different numbers of rows). The positional arguments are ring-flash-attn's, in its
    order; strategy, seqlen and softcap are keyword-only. Returns this rank's rows of out, or
    (out, softmax_lse, None)
    with return_attn_probs; softmax_lse is float32 (batch, nheads, s_local).

    `group`: a torch.distributed ProcessGroup (None: the default group; CUDA tensors) or a
    flare.dist.Communicator. Dropout and ALiBi are not supported across ranks yet
    (NotImplementedError); sliding windows where the strategy supports them.
    """
    _local_shapes(q, k, v)
    _check_unsupported(group, dropout_p, alibi_slopes)
    return_attn_probs = _core.flag(return_attn_probs, "return_attn_probs")
    comm = _resolve_group(group, q)
    b, s_local, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    guessed = seqlen is None
    if guessed:
        seqlen = s_local * comm.world_size
    key = plan_key(strategy=strategy, batch=b, seqlen=seqlen, heads_q=heads_q,
                   heads_kv=heads_kv, head_dim=head_dim, dtype=_ext.dtype_code(q, "q"),
                   causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, deterministic=deterministic, backend="auto")
    try:
        plan = comm._plan(key)
    except ValueError as e:
        if guessed and "disagree on seqlen" in str(e):
            raise ValueError(f"seqlen: the ranks hold different numbers of rows, so the global "
                             f"length cannot be s_local * world_size; pass seqlen= ({e})") from None
        raise
    return _attend(q, k, v, plan, return_attn_probs)


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen=None, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None, *, strategy="zigzag", softcap=0.0):
    """Context-parallel attention over a packed batch of sequences, with autograd.

    cu_seqlens: the global pack's offsets (host ints: a list, a NumPy array or a CPU tensor;
    batch + 1 of them, the same on every rank); every sequence is split across the ranks on its
    own in `strategy`'s layout (shard_varlen). q (local rows, nheads, headdim), k / v (local
    rows, nheads_k, headdim): this rank's pack, sequence after sequence (varlen_local_cu_seqlens
    gives its offsets). max_seqlen is taken for ring-flash-attn's signature and checked (None or
    an int); the plan reads the offsets. Returns this rank's rows of out, or (out, softmax_lse,
    None) with return_attn_probs; softmax_lse is float32 (nheads, local rows). The rest as
    ring_flash_attn_func.
    """
    _local_shapes(q, k, v, packed=True)
    _check_unsupported(group, dropout_p, alibi_slopes)
    if max_seqlen is not None:
        _core.integer(max_seqlen, "max_seqlen", 0, (1 << 31) - 1)
    return_attn_probs = _core.flag(return_attn_probs, "return_attn_probs")
    comm = _resolve_group(group, q)
    key = plan_key(strategy=strategy, batch=None, seqlen=None, heads_q=q.shape[1],
                   heads_kv=k.shape[1], head_dim=q.shape[2], dtype=_ext.dtype_code(q, "q"),
                   causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, deterministic=deterministic, backend="auto",
                   cu_seqlens=cu_seqlens)
    return _attend(q, k, v, comm._plan(key), return_attn_probs)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                return_attn_probs=False, group=None, *, seqlen=None,
                                softcap=0.0):
    """ring_flash_attn_func with strategy="zigzag" (ring-flash-attn's name for it)."""
    return ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                alibi_slopes, deterministic, return_attn_probs, group,
                                strategy="zigzag", seqlen=seqlen, softcap=softcap)


# ---- sequence layout for torch and NumPy arrays ------------------------------------------------

def _rows(x, dim, start, length):
    return x[(slice(None),) * dim + (slice(start, start + length),)]


def _concat(parts, dim, like):
    if _core.is_torch(like):
        import torch
        return torch.cat(parts, dim)
    return _core._numpy().concatenate(parts, axis=dim)


def _seq_dim(x, dim, name):
    dim = _core.integer(dim, "dim")
    if not hasattr(x, "shape") or _core.array_group(x) is None:
        raise TypeError(f"{name}: expected a torch tensor or NumPy array, got {_core.describe(x)}")
    ndim = len(x.shape)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: {dim} is out of range for {name} of shape {tuple(x.shape)}")
    return dim % ndim


def shard_sequence(x, rank, world_size, *, strategy="zigzag", dim=1):
    """Rank `rank`'s rows of a full tensor x along `dim` (1 for (b, s, h, d); 2 for an lse
    (b, h, s)), in `strategy`'s layout, as a new tensor of the same framework (differentiable for
    torch). Any device: the layout is index arithmetic, the copy is the framework's."""
    world_size = _int_arg(world_size, "world_size", 1)
    rank = _core.integer(rank, "rank", 0, world_size - 1)
    dim = _seq_dim(x, dim, "x")
    chunks = _ext.sequence_shard(strategy_code(strategy), int(x.shape[dim]), world_size, rank)
    return _concat([_rows(x, dim, g, n) for g, _, n in chunks], dim, x)


def _shards_dim(shards, dim):
    """`dim` normalised against every rank's tensor; shards must be a non-empty list of them."""
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards: expected a non-empty list of every rank's tensors, got "
                        f"{_core.describe(shards)}")
    dim = _seq_dim(shards[0], dim, "shards[0]")
    for r, s in enumerate(shards[1:], 1):
        _seq_dim(s, dim, f"shards[{r}]")
    return dim


def _assemble(shards, dim, chunks_of, whole):
    """The whole tensor from every rank's rows, chunks_of(r) giving rank r's
    [(global_begin, local_begin, length), ...]; a shard of another row count is named, against
    `whole` (what the ranks share)."""
    pieces = []  # (global_begin, rank, local_begin, length)
    for r, s in enumerate(shards):
        chunks = chunks_of(r)
        want = sum(c[2] for c in chunks)
        if s.shape[dim] != want:
            raise ValueError(f"shards[{r}]: {s.shape[dim]} rows along dim {dim}, but rank {r} of "
                             f"{len(shards)} holds {want} of {whole}")
        pieces += [(g, r, lb, n) for g, lb, n in chunks]
    pieces.sort()
    return _concat([_rows(shards[r], dim, lb, n) for _, r, lb, n in pieces], dim, shards[0])


def unshard_sequence(shards, *, strategy="zigzag", dim=1):
    """The full tensor from every rank's rows (shards[r] is rank r's, as shard_sequence gives
    them): the inverse of shard_sequence. Differentiable for torch."""
    dim = _shards_dim(shards, dim)
    total = sum(int(s.shape[dim]) for s in shards)
    code = strategy_code(strategy)
    return _assemble(shards, dim, lambda r: _ext.sequence_shard(code, total, len(shards), r),
                     f"a {total}-row sequence ({strategy})")


# ---- packed batches: every sequence split on its own -------------------------------------------

def _host_offsets(cu_seqlens):
    """cu_seqlens as a tuple of ints: a list or tuple of ints, a 1-D integer NumPy array or CPU
    tensor, at least two entries (the library checks the values: 0 first, non-decreasing)."""
    if _core.is_torch(cu_seqlens):
        if cu_seqlens.is_cuda:
            raise ValueError("cu_seqlens: must be host memory (a list, a NumPy array or a CPU "
                             "tensor): every rank's plan is built from it on the host")
        cu_seqlens = cu_seqlens.detach().numpy()
    np = _core._numpy()
    if isinstance(cu_seqlens, (list, tuple)):
        if not all(isinstance(c, numbers.Integral) and not isinstance(c, bool)
                   for c in cu_seqlens):
            raise TypeError("cu_seqlens: expected integers")
        values = tuple(int(c) for c in cu_seqlens)
    elif isinstance(cu_seqlens, np.ndarray) and cu_seqlens.dtype.kind in "iu":
        if cu_seqlens.ndim != 1:
            raise ValueError(f"cu_seqlens: expected 1 dimension, got shape {cu_seqlens.shape}")
        values = tuple(int(c) for c in cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens: expected a list of ints, an integer NumPy array or a CPU "
                        f"tensor, got {_core.describe(cu_seqlens)}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens: expected batch + 1 >= 2 offsets, got {len(values)}")
    for i, (a, b) in enumerate(zip(values, values[1:])):
        if values[0] != 0 or b < a or b >= (1 << 31):
            raise ValueError(f"cu_seqlens: must start at 0 and not decrease, within int32 "
                             f"(entries {i}, {i + 1}: {a}, {b})")
    return values


def _varlen_chunks(code, cu, world_size, rank):
    """Rank `rank`'s rows of a pack: [(global_begin, local_begin, length), ...] sequence by
    sequence, each sequence cut by sequence_shard on its own (include/flare/dist.h), and the
    local pack's offsets."""
    chunks, local_cu, at = [], [0], 0
    for begin, end in zip(cu, cu[1:]):
        for g, _, n in _ext.sequence_shard(code, end - begin, world_size, rank):
            chunks.append((begin + g, at, n))
            at += n
        local_cu.append(at)
    return chunks, local_cu


def varlen_local_cu_seqlens(cu_seqlens, rank, world_size, *, strategy="zigzag"):
    """The offsets of rank `rank`'s pack (shard_varlen's rows): sequence i at local rows
    [c[i], c[i + 1])."""
    world_size = _int_arg(world_size, "world_size", 1)
    rank = _core.integer(rank, "rank", 0, world_size - 1)
    return _varlen_chunks(strategy_code(strategy), _host_offsets(cu_seqlens), world_size,
                          rank)[1]


def shard_varlen(x, cu_seqlens, rank, world_size, *, strategy="zigzag", dim=0):
    """Rank `rank`'s rows of a packed tensor x along `dim` (0 for (total, h, d); 1 for an lse
    (h, total)): every sequence of the pack (cu_seqlens, the global offsets) cut across the ranks
    on its own in `strategy`'s layout, this rank's pieces one sequence after another. A new
    tensor of the same framework (differentiable for torch)."""
    world_size = _int_arg(world_size, "world_size", 1)
    rank = _core.integer(rank, "rank", 0, world_size - 1)
    dim = _seq_dim(x, dim, "x")
    cu = _host_offsets(cu_seqlens)
    if x.shape[dim] != cu[-1]:
        raise ValueError(f"x: {x.shape[dim]} rows along dim {dim}, but cu_seqlens ends at "
                         f"{cu[-1]}")
    chunks = _varlen_chunks(strategy_code(strategy), cu, world_size, rank)[0]
    return _concat([_rows(x, dim, g, n) for g, _, n in chunks], dim, x)


def unshard_varlen(shards, cu_seqlens, *, strategy="zigzag", dim=0):
    """The packed tensor from every rank's rows (shards[r] is rank r's, as shard_varlen gives
    them): the inverse of shard_varlen. Differentiable for torch."""
    dim = _shards_dim(shards, dim)
    cu = _host_offsets(cu_seqlens)
    code = strategy_code(strategy)
    return _assemble(shards, dim, lambda r: _varlen_chunks(code, cu, len(shards), r)[0],
                     f"the pack ({strategy})")


def zigzag_shard(x, rank, world_size, dim=1):
    """shard_sequence in the zigzag layout: rank r gets chunks r and 2n-1-r of 2n."""
    return shard_sequence(x, rank, world_size, strategy="zigzag", dim=dim)


def zigzag_unshard(shards, dim=1):
    """unshard_sequence of the zigzag layout."""
    return unshard_sequence(shards, strategy="zigzag", dim=dim)


__all__ = [
    "Communicator",
    "ContextParallelAttention",
    "launch_info",
    "nccl_built",
    "nccl_unique_id",
    "release_process_group_communicators",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "shard_sequence",
    "shard_varlen",
    "unshard_sequence",
    "unshard_varlen",
    "varlen_local_cu_seqlens",
    "zigzag_ring_flash_attn_func",
    "zigzag_shard",
    "zigzag_unshard",
]
