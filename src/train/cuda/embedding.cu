// embedding.cu — token and position embedding, forward and backward (embedding.h).
#include "train/cuda/embedding.h"

#include <climits>
#include <type_traits>

#include "core/message.h"
#include "train/cuda/device.cuh"

namespace flare::train::cuda {
namespace {

constexpr int kOwnerThreads = 256;  // tokens scanned per step by an owner block

struct EmbeddingParams {
  const int32_t* tokens;       // (rows)
  const bf16* token_table;     // (vocab, channels)
  const bf16* position_table;  // (≥ seq_len, channels) or null
  bf16* out;                   // (rows, channels)
  const bf16* dout;            // (rows, channels), backward
  void* dtoken_table;          // (vocab, channels) fp32 or bf16 (G of the kernels), backward
  void* dposition_table;       // (≥ seq_len, channels) or null, backward
  int32_t* first;              // (vocab) scratch: first position of each token in the batch
  int32_t* count;              // (vocab) scratch: occurrences of each token
  const int64_t* positions;    // (seq_len) each row's position in the table, or null: its index
  int64_t rows, seq_len, vocab, channels;
};

// The position-table row of the row at index j of its sequence.
__device__ __forceinline__ int64_t table_row(const EmbeddingParams& p, int64_t j) {
  return p.positions ? p.positions[j] : j;
}

template <int kVec>
__global__ void embedding_forward_kernel(const EmbeddingParams p) {
  const int64_t idx = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (idx >= p.rows * p.channels) return;
  const int64_t n = idx / p.channels, c = idx % p.channels;
  const int32_t token = p.tokens[n];
  float v[kVec];
  if (token < 0 || token >= p.vocab) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = __int_as_float(0x7fc00000);  // NaN marks the bad token
  } else {
    load_floats<kVec>(p.token_table + token * p.channels + c, v);
    if (p.position_table) {
      float pos[kVec];
      load_floats<kVec>(p.position_table + table_row(p, n % p.seq_len) * p.channels + c, pos);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] += pos[i];
    }
  }
  store_floats<kVec>(p.out + idx, v);
}

__global__ void embedding_first_kernel(const EmbeddingParams p) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= p.rows) return;
  const int32_t token = p.tokens[n];
  if (token < 0 || token >= p.vocab) return;
  atomicMin(p.first + token, static_cast<int32_t>(n));
  atomicAdd(p.count + token, 1);
}

// A gradient element of type G (float or bf16) as a float and back.
__device__ __forceinline__ float grad_value(float g) { return g; }
__device__ __forceinline__ float grad_value(bf16 g) { return __bfloat162float(g); }
template <typename G>
__device__ __forceinline__ G grad_store(float v) {
  if constexpr (std::is_same_v<G, float>)
    return v;
  else
    return __float2bfloat16_rn(v);
}

// Block n owns the table row of tokens[n] when n is that token's first position.
template <typename G>
__global__ void __launch_bounds__(kOwnerThreads) embedding_owner_kernel(const EmbeddingParams p) {
  __shared__ int32_t list[kOwnerThreads];
  __shared__ int32_t warp_count[kOwnerThreads / 32];
  const int64_t n0 = blockIdx.x;
  const int32_t token = p.tokens[n0];
  if (token < 0 || token >= p.vocab || p.first[token] != n0) return;
  const int32_t total = p.count[token];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  G* row = static_cast<G*>(p.dtoken_table) + token * p.channels;
  int32_t found = 0;
  for (int64_t start = n0; start < p.rows && found < total; start += kOwnerThreads) {
    // Collect this step's occurrences in position order: warp by warp, lane by lane.
    const int64_t n = start + threadIdx.x;
    const bool match = n < p.rows && p.tokens[n] == token;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0, step_total = 0;
    for (int w = 0; w < kOwnerThreads / 32; ++w) {
      if (w < warp) offset += warp_count[w];
      step_total += warp_count[w];
    }
    if (match) list[offset + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>(n);
    __syncthreads();
    for (int64_t c = threadIdx.x; c < p.channels; c += kOwnerThreads) {
      float acc = grad_value(row[c]);
      for (int k = 0; k < step_total; ++k) acc += __bfloat162float(p.dout[list[k] * p.channels + c]);
      row[c] = grad_store<G>(acc);
    }
    found += step_total;
    __syncthreads();  // list and warp_count are rewritten by the next step
  }
}

template <typename G>
__global__ void embedding_position_backward_kernel(const EmbeddingParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t positions = p.rows < p.seq_len ? p.rows : p.seq_len;
  if (idx >= positions * p.channels) return;
  const int64_t pos = idx / p.channels, c = idx % p.channels;
  G* grad = static_cast<G*>(p.dposition_table) + table_row(p, pos) * p.channels + c;  // rows are distinct
  float acc = grad_value(*grad);
  for (int64_t n = pos; n < p.rows; n += p.seq_len) acc += __bfloat162float(p.dout[n * p.channels + c]);
  *grad = grad_store<G>(acc);
}

Status check_sizes(const char* op, int64_t rows, int64_t seq_len, int64_t vocab, int64_t channels) {
  if (rows < 1 || rows > INT_MAX) return invalid(op, ": rows = ", rows, " must be in [1, 2^31)");
  if (seq_len < 1) return invalid(op, ": seq_len = ", seq_len, " must be >= 1");
  if (vocab < 1 || vocab > INT_MAX) return invalid(op, ": vocab_size = ", vocab, " must be in [1, 2^31)");
  if (channels < 1) return invalid(op, ": channels = ", channels, " must be >= 1");
  return Status::ok_status();
}

}  // namespace

Status embedding_forward(const int32_t* tokens, const bf16* token_table,
                         const bf16* position_table, bf16* out, int64_t rows, int64_t seq_len,
                         int64_t vocab_size, int64_t channels, cudaStream_t stream,
                         const int64_t* positions) {
  const char* op = "embedding_forward";
  FLARE_RETURN_IF_ERROR(check_sizes(op, rows, seq_len, vocab_size, channels));
  if (tokens == nullptr || token_table == nullptr || out == nullptr)
    return invalid(op, ": tokens, token_table and out must not be null");
  EmbeddingParams p{};
  p.tokens = tokens;
  p.token_table = token_table;
  p.position_table = position_table;
  p.positions = positions;
  p.out = out;
  p.rows = rows;
  p.seq_len = seq_len;
  p.vocab = vocab_size;
  p.channels = channels;
  const bool vec = channels % 8 == 0 && aligned16(token_table) && aligned16(out) &&
                   (position_table == nullptr || aligned16(position_table));
  if (vec)
    embedding_forward_kernel<8><<<ceil_div(rows * channels / 8, 256), 256, 0, stream>>>(p);
  else
    embedding_forward_kernel<1><<<ceil_div(rows * channels, 256), 256, 0, stream>>>(p);
  return launch_status(kCudaContext, op);
}

int64_t embedding_backward_scratch_bytes(int64_t vocab_size) {
  return 2 * vocab_size * static_cast<int64_t>(sizeof(int32_t));
}

Status embedding_backward(const bf16* dout, const int32_t* tokens, GradientOut dtoken_table,
                          GradientOut dposition_table, int64_t rows, int64_t seq_len,
                          int64_t vocab_size, int64_t channels, void* scratch,
                          cudaStream_t stream, const int64_t* positions) {
  const char* op = "embedding_backward";
  FLARE_RETURN_IF_ERROR(check_sizes(op, rows, seq_len, vocab_size, channels));
  if (dout == nullptr || tokens == nullptr || !dtoken_table || scratch == nullptr)
    return invalid(op, ": dout, tokens, dtoken_table and scratch must not be null");
  if (dposition_table && dposition_table.is_bf16() != dtoken_table.is_bf16())
    return invalid(op, ": dtoken_table and dposition_table must have one type (both fp32 or both bf16)");
  EmbeddingParams p{};
  p.tokens = tokens;
  p.dout = dout;
  p.dtoken_table = dtoken_table.data();
  p.dposition_table = dposition_table.data();
  p.positions = positions;
  p.first = static_cast<int32_t*>(scratch);
  p.count = p.first + vocab_size;
  p.rows = rows;
  p.seq_len = seq_len;
  p.vocab = vocab_size;
  p.channels = channels;
  // first = 0x7f7f7f7f (past any position), count = 0.
  FLARE_RETURN_IF_ERROR(cuda_status(
      kCudaContext, op, cudaMemsetAsync(p.first, 0x7f, vocab_size * sizeof(int32_t), stream)));
  FLARE_RETURN_IF_ERROR(cuda_status(
      kCudaContext, op, cudaMemsetAsync(p.count, 0, vocab_size * sizeof(int32_t), stream)));
  embedding_first_kernel<<<ceil_div(rows, 256), 256, 0, stream>>>(p);
  const bool b16 = dtoken_table.is_bf16();
  if (b16)
    embedding_owner_kernel<bf16><<<static_cast<unsigned>(rows), kOwnerThreads, 0, stream>>>(p);
  else
    embedding_owner_kernel<float><<<static_cast<unsigned>(rows), kOwnerThreads, 0, stream>>>(p);
  if (dposition_table) {
    const int64_t positions = rows < seq_len ? rows : seq_len;
    const unsigned grid = ceil_div(positions * channels, 256);
    if (b16)
      embedding_position_backward_kernel<bf16><<<grid, 256, 0, stream>>>(p);
    else
      embedding_position_backward_kernel<float><<<grid, 256, 0, stream>>>(p);
  }
  return launch_status(kCudaContext, op);
}

}  // namespace flare::train::cuda
