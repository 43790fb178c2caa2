// flare/dist.h — context parallelism: one sequence split across ranks, attention computed as if
// it were on one device.
//
// Three layers, each usable alone:
//   1. Communicator: rank, size, point-to-point exchanges and collectives, every operation bounded
//      by a timeout (a dead or missing peer is an error naming the operation and the peer, never a
//      hang). Two implementations: in-process (threads sharing host memory; the whole algorithm
//      runs and is tested on the CPU) and NCCL (GPUs; built when CUDA and NCCL are found).
//   2. Sequence layout: which global rows each rank holds (contiguous chunks, or the zigzag layout
//      that balances causal work; a packed variable-length batch cut sequence by sequence), as
//      pure index functions, plus shard / unshard copies (host or CUDA tensors).
//   3. ContextParallelAttention: forward and backward over a communicator. Ring and zigzag: K/V
//      blocks travel around the ring while each rank attends its queries to the block it holds;
//      partial (O, LSE) pairs are merged in fp32; the backward sends dK/dV back to their owners,
//      dQ stays local. All-to-all: ranks trade sequence rows for heads and back.
// docs/context-parallel.md describes the design, the launch (mpirun, torchrun) and what is missing.
//
// Local tensors have the single-device layout of attention.h with the sequence dimension holding
// this rank's rows only: q, o, dout, dq (b, s_local, h_q, d); k, v, dk, dv (b, s_local, h_kv, d);
// lse (b, h_q, s_local) fp32, in the order sequence_shard() gives. A packed variable-length batch
// (ContextParallelConfig::cu_seqlens) is split sequence by sequence: q, o, dout, dq
// (total_local, h_q, d); k, v, dk, dv (total_local, h_kv, d); lse (h_q, total_local), in the order
// varlen_shard() gives (each sequence's rows of this rank, sequences in batch order).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flare/attention.h"
#include "flare/status.h"
#include "flare/tensor.h"

namespace flare::dist {

// ---- communicator -----------------------------------------------------------------------------

struct CommOptions {
  // Every operation: a peer that has not taken part within this many milliseconds makes the
  // operation fail, and the communicator unusable (as after an NCCL abort). Must be > 0.
  int timeout_ms = 300000;
};

enum class ReduceOp : int { kSum = 0, kMax = 1, kMin = 2 };

// One side of a point-to-point transfer; an exchange posts several that progress together.
struct Transfer {
  enum class Kind : int { kSend = 0, kRecv = 1 };
  Kind kind = Kind::kSend;
  int peer = 0;
  void* data = nullptr;  // read for a send, written for a receive
  int64_t bytes = 0;     // a receive must be sent exactly this many bytes

  static Transfer send(int peer, const void* data, int64_t bytes) {
    return {Kind::kSend, peer, const_cast<void*>(data), bytes};
  }
  static Transfer recv(int peer, void* data, int64_t bytes) {
    return {Kind::kRecv, peer, data, bytes};
  }
};

// A group of ranks. One object per rank, used by one thread at a time. Every rank must issue the
// same operations in the same order (as with NCCL). Buffers live on device() (host memory for the
// in-process communicator, device memory of device_index() for NCCL).
//
// Data operations are stream-ordered: NCCL enqueues them on `stream` and returns (no host wait);
// the in-process communicator completes them before returning and ignores the stream. Errors
// that surface later (a peer that died mid-transfer) are caught by the timeout: the operation's
// own call, a later one, barrier() or health() reports them.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual DeviceType device() const = 0;
  virtual int device_index() const = 0;
  virtual int timeout_ms() const = 0;
  virtual const char* kind() const = 0;  // "in-process" or "nccl"

  // Posts every send and receive of `transfers` at once (a ring step is one send to the next rank
  // and one receive from the previous), so that no ordering of them between ranks deadlocks.
  virtual Status exchange(const Transfer* transfers, int count, Stream stream = nullptr) = 0;
  // Element-wise reduction of `count` elements of `dtype` over all ranks into recv on every rank
  // (recv may equal send). float32, float16, bfloat16, int32.
  virtual Status all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                            Stream stream = nullptr) = 0;
  // recv holds size() slots of `bytes` each; slot r receives rank r's send.
  virtual Status all_gather(const void* send, void* recv, int64_t bytes,
                            Stream stream = nullptr) = 0;
  // send and recv hold size() slots of `bytes` each; slot p of send goes to rank p, slot p of recv
  // comes from rank p.
  virtual Status all_to_all(const void* send, void* recv, int64_t bytes,
                            Stream stream = nullptr) = 0;
  // Host-blocking: returns once every rank has arrived and this rank's earlier operations have
  // completed, or fails at the timeout naming the ranks that did not arrive.
  virtual Status barrier() = 0;
  // Host-blocking all-gather of host memory, for agreement at setup time (shapes, plans).
  virtual Status host_all_gather(const void* send, void* recv, int64_t bytes) = 0;
  // OK, or the error that made this communicator unusable (every later operation returns it).
  virtual Status health() = 0;

  // One send or one receive (an exchange of one transfer).
  Status send(int peer, const void* data, int64_t bytes, Stream stream = nullptr);
  Status recv(int peer, void* data, int64_t bytes, Stream stream = nullptr);
};

// `size` in-process communicators of one group, comms[r] being rank r's. Each is meant for its own
// thread; a rank whose thread never calls in makes the others' operations fail at the timeout.
Status make_in_process_group(int size, const CommOptions& options,
                             std::vector<std::unique_ptr<Communicator>>* comms);

// ---- NCCL (GPUs) ------------------------------------------------------------------------------
// Built when CUDA and NCCL are found (nccl_built()); otherwise these return kUnsupported.

bool nccl_built();

// NCCL's unique id (ncclUniqueId, 128 bytes): rank 0 makes it, every rank needs it.
struct NcclId {
  unsigned char bytes[128] = {};
};
Status nccl_unique_id(NcclId* id);

// A non-blocking NCCL communicator on CUDA device `device`, rank `rank` of `size`. Operations are
// polled against the timeout; one that does not finish in time aborts the communicator.
Status make_nccl_communicator(const NcclId& id, int rank, int size, int device,
                              const CommOptions& options, std::unique_ptr<Communicator>* comm);
// Wraps a caller's ncclComm_t (passed as void*). With take_ownership it is destroyed with the
// wrapper; otherwise the caller keeps it. Either way a timeout aborts it (ncclCommAbort frees it:
// the caller must not use or destroy it after health() reports a failure). A blocking
// communicator's calls cannot be interrupted: only a non-blocking one (ncclConfig_t blocking = 0)
// is bounded by the timeout in every case.
Status adopt_nccl_communicator(void* nccl_comm, bool take_ownership, const CommOptions& options,
                               std::unique_ptr<Communicator>* comm);

// ---- launch environment and rendezvous ----------------------------------------------------------

// Where this process sits in a launch. From torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT) or, failing those, mpirun's (OMPI_COMM_WORLD_RANK, _SIZE,
// _LOCAL_RANK); MASTER_ADDR / MASTER_PORT default to 127.0.0.1:29500 (one node).
struct LaunchInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source;  // "torchrun" or "mpirun": which variables were read
};
Status launch_info_from_env(LaunchInfo* info);

// Sends rank 0's `bytes` of `data` to every other rank over TCP (rank 0 listens on
// master_addr:master_port; the others connect, retrying until the timeout). Checks that every
// rank agrees on the world size and that no rank appears twice. Each rank writes `data` in place
// (rank 0's is read). Blocking; a rank that does not arrive within timeout_ms is named in the
// error.
Status rendezvous_broadcast(const LaunchInfo& info, void* data, int64_t bytes, int timeout_ms);

// The launcher's path in one call: reads the environment, shares rank 0's NCCL id through the
// rendezvous and creates the communicator on CUDA device LOCAL_RANK.
Status make_nccl_communicator_from_env(const CommOptions& options,
                                       std::unique_ptr<Communicator>* comm,
                                       LaunchInfo* info = nullptr);

// ---- sequence layout ----------------------------------------------------------------------------

enum class Strategy : int {
  // Rank r holds the r-th of `size` contiguous chunks. With a causal mask, rank r's queries see
  // only ranks ≤ r's keys: ranks do unequal work.
  kRing = 0,
  // The sequence is cut into 2·size chunks and rank r holds chunks r and 2·size−1−r, so that
  // under a causal mask every rank does the same work (ranks differ by at most a row).
  kZigzag = 1,
  // Head-parallel (Ulysses-style): rows laid out as kRing, then one all-to-all gives each rank
  // every row of heads_q/size query heads and heads_kv/size K/V heads (both must divide), a
  // single-device call runs over the whole sequence, and a second all-to-all returns the rows.
  // No merge; sliding windows work as on one device.
  kAllToAll = 2,
};
const char* strategy_name(Strategy strategy);

// A run of consecutive global rows held by one rank.
struct SequenceChunk {
  int64_t global_begin = 0;
  int64_t local_begin = 0;  // where the run starts in the rank's local rows
  int64_t length = 0;
};

// The rows a rank holds, in local order: chunk[0] then chunk[1] (kRing and kAllToAll use one). Chunk
// lengths differ by at most one row: a sequence of s rows cut into c chunks gives the first
// s mod c chunks ⌈s/c⌉ rows and the rest ⌊s/c⌋ (no padding; chunks may be empty when s < c).
struct SequenceShard {
  int count = 0;
  SequenceChunk chunk[2];
  int64_t length = 0;  // local rows: the sum of the chunks' lengths
};
Status sequence_shard(Strategy strategy, int64_t seqlen, int size, int rank, SequenceShard* shard);

// Copies rank `rank`'s rows of a full tensor into `local`, or `local` back into its rows of
// `full`. seq_dim is the sequence dimension: 1 for q/k/v/o (b, s, h, d), 2 for lse (b, h, s).
// CPU tensors of one dtype whose other dimensions agree.
Status shard_sequence(const TensorView& full, int seq_dim, Strategy strategy, int size, int rank,
                      const TensorView& local);
Status unshard_sequence(const TensorView& local, int seq_dim, Strategy strategy, int size,
                        int rank, const TensorView& full);
// The same copies for CPU tensors or CUDA tensors of one device (then stream-ordered on `stream`:
// the call enqueues and returns; the caller keeps both tensors alive until the stream has run).
Status shard_sequence(const TensorView& full, int seq_dim, Strategy strategy, int size, int rank,
                      const TensorView& local, Stream stream);
Status unshard_sequence(const TensorView& local, int seq_dim, Strategy strategy, int size,
                        int rank, const TensorView& full, Stream stream);

// ---- packed variable-length batches -------------------------------------------------------------
// A packed batch (attention.h's varlen layout, sequence i holding rows cu_seqlens[i] up to
// cu_seqlens[i + 1] of the global pack) is split sequence by sequence: sequence i is cut by
// sequence_shard(strategy, its length, size, rank) on its own (zigzag: chunks r and 2·size−1−r of
// that sequence, so every sequence's causal work is balanced; ring: its r-th contiguous chunk),
// and a rank packs its rows of every sequence one after another, sequences in batch order (zigzag:
// the early chunk, then the late one). Sequences shorter than the chunk count, empty sequences and
// lengths not divisible by the ranks give empty or uneven chunks, as for one sequence; a rank may
// hold no row of a sequence (its local length is then 0) or no row at all.
//
// cu_seqlens here are host memory, int32, batch + 1 entries: 0 first, non-decreasing.

// What rank `rank` holds of a packed batch.
struct VarlenShard {
  // Per sequence, its rows at this rank: chunk global_begin counts rows of the global pack
  // (cu_seqlens[i] + the row within the sequence), local_begin rows of this rank's pack.
  std::vector<SequenceShard> sequences;
  // This rank's pack as attention.h's varlen arguments take it: batch + 1 offsets, sequence i at
  // local rows [cu_seqlens[i], cu_seqlens[i + 1]).
  std::vector<int32_t> cu_seqlens;
  int64_t length = 0;   // local rows (cu_seqlens.back())
  int max_seqlen = 0;   // the longest local sequence
};
Status varlen_shard(Strategy strategy, const std::vector<int32_t>& cu_seqlens, int size, int rank,
                    VarlenShard* shard);

// Copies rank `rank`'s rows of a packed tensor into `local` (its pack, varlen_shard's order), or
// `local` back into `full`. seq_dim is the packed token dimension: 0 for q/k/v/o (total, h, d),
// 1 for lse (h, total). CPU tensors, or CUDA tensors of one device, stream-ordered on `stream`
// (enqueued, no host wait). One dtype; the other dimensions must agree.
Status shard_varlen(const TensorView& full, int seq_dim, Strategy strategy,
                    const std::vector<int32_t>& cu_seqlens, int size, int rank,
                    const TensorView& local, Stream stream = nullptr);
Status unshard_varlen(const TensorView& local, int seq_dim, Strategy strategy,
                      const std::vector<int32_t>& cu_seqlens, int size, int rank,
                      const TensorView& full, Stream stream = nullptr);

// ---- context-parallel attention ------------------------------------------------------------------

// What every rank agrees on. Self-attention: q, k and v share one global sequence.
struct ContextParallelConfig {
  Strategy strategy = Strategy::kZigzag;
  int batch = 0;
  int64_t seqlen = 0;  // global sequence length
  int heads_q = 0;
  int heads_kv = 0;    // divides heads_q (GQA/MQA: K/V travel with heads_kv heads, never expanded)
  int head_dim = 0;
  DType dtype = DType::kBFloat16;
  // causal, window_left / window_right, softmax_scale, softcap, deterministic and backend are
  // honoured, every mask over global positions as on one device (the ring and zigzag give each
  // block call the window its rows and keys see; blocks the mask hides entirely are skipped, not
  // computed). ALiBi and dropout would need each block's global position inside the kernels, which
  // the single-device API cannot take yet: refused (kUnsupported).
  AttentionOptions attention;
  // A packed variable-length batch: the global pack's cu_seqlens (host, batch + 1 entries, 0 first,
  // non-decreasing; see varlen_shard for the rows each rank holds). Empty: fixed length. With it,
  // batch and seqlen are the number of sequences and the packed token count (0: taken from
  // cu_seqlens; other values must match it). Every strategy.
  std::vector<int32_t> cu_seqlens;
};

// Where the calls' time went, summed over the calls since the last take_timing(): the time the
// communication stream spent in exchanges (CUDA events around each), the time the caller's stream
// spent computing between its waits for communication, and what this rank sent. Exposed
// communication is then about (wall time − compute_ms); the rest of comm_ms overlapped. Times are
// measured on CUDA devices only (0 on the host path, which still counts bytes and exchanges).
struct CpTiming {
  int calls = 0;
  int exchanges = 0;
  int64_t bytes_sent = 0;
  double comm_ms = 0.0;
  double compute_ms = 0.0;
};

class ContextParallelAttention {
 public:
  // Collective: every rank of `comm` calls it with its own copy of the config; each rank checks
  // every other rank's against its own, so all of them fail alike on a mismatch. `comm` must
  // outlive the object. One object per rank, used by one thread at a time. Allocates the plan's
  // workspace once, in the memory `comm` moves (host, or its CUDA device: float16 or bfloat16).
  //
  // On CUDA devices the calls are stream-ordered: they enqueue on `stream` (the transfers on a
  // stream of the plan's own, ordered by events) and return without waiting. Calls on one object
  // share its workspace, so they must be ordered on the device (one stream, or the caller's
  // synchronisation). A peer that dies mid-call is found by the communicator's timeout: the call,
  // the next one or comm->health() reports it, and the stream drains (docs/context-parallel.md).
  static Status create(Communicator* comm, const ContextParallelConfig& config,
                       std::unique_ptr<ContextParallelAttention>* out);
  ~ContextParallelAttention();

  // Collective forward: writes this rank's rows of o and lse (shapes: the top of this file; a
  // packed plan's local cu_seqlens are the plan's own, varlen_shard().cu_seqlens).
  Status forward(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& o, const TensorView& lse, Stream stream = nullptr);
  // Collective backward: given the forward's o and lse, writes this rank's dq, dk and dv.
  Status backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& o, const TensorView& lse,
                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                  Stream stream = nullptr);

  // Timing of later calls (off by default: its events cost a little). take_timing() waits on the
  // host for the recorded events of the calls since the last read, then resets the sums.
  Status set_timing(bool on);
  Status take_timing(CpTiming* out);

  const ContextParallelConfig& config() const;
  // This rank's rows. Of a packed variable-length plan: count 0 and length = the local rows; the
  // rows themselves are varlen_shard()'s.
  const SequenceShard& shard() const;
  // Of a packed variable-length plan, this rank's rows of every sequence (empty otherwise).
  const VarlenShard& varlen_shard() const;

  struct State;

 private:
  explicit ContextParallelAttention(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace flare::dist
