// block_sparse_flash.cpp — the CPU backend of block-sparse attention: tiled online softmax over
// the mask's own blocks, so the work is proportional to the blocks that are on.
//
// What. The semantics of flare/attention.h with every option (varlen, GQA/MQA, s_q != s_k,
// causal / sliding window, softcap, ALiBi, dropout), restricted by a block mask
// (flare/block_sparse.h), in fp32 arithmetic on fp32/fp16/bf16 tensors. A tile is one
// (query block, key block) pair of the mask, block_m × block_n (clipped to the sequence); a tile
// whose mask entry is off, or that the window does not reach, is skipped before its K and V are
// loaded, so an off block costs one mask read and its contents (even NaN) never reach a result.
// Within a tile each row sums only the keys it sees, one at a time: no product ever multiplies a
// masked key by 0, so non-finite values propagate exactly as in the reference.
//
// Threads (OpenMP, dynamic schedule) and a deterministic backward, as in flash.cpp: every output
// element is summed by one task in a fixed order:
//   forward  one task per (batch, query head, query block): online softmax over its key blocks.
//   pass 0   D_i = dO_i·O_i per row, into a (heads_q, total_q) buffer.
//   pass 1   one task per (batch, kv head, key block): dK, dV over the query heads of its group
//            and the query blocks the mask turns on.
//   pass 2   one task per (batch, query head, query block): dQ over its key blocks.
// The inner loops are plain dot products and axpys over head_dim that the compiler vectorises;
// speed here is secondary to being the CPU twin of the GPU kernels to come and cost-proportional.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

#include "core/backends.h"
#include "core/block_mask.h"
#include "core/block_sparse_backends.h"
#include "core/numeric.h"
#include "core/params.h"
#include "core/philox.h"
#include "core/score_mod.h"
#include "cpu/head_location.h"
#include "cpu/row_finish.h"

namespace flare::cpu {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- geometry -----------------------------------------------------------------------------------

// Rows [i0, i0 + rows) and keys [j0, j0 + cols) of one tile, with each row's visible key range
// (from the window) clipped to the tile: row r meets keys [lo[r], hi[r]), empty when lo ≥ hi.
struct Tile {
  int i0 = 0, rows = 0, j0 = 0, cols = 0;
  std::vector<int> lo, hi;
  bool any = false;  // some row meets some key
};

void clip_tile(const AttentionParams& p, const SequenceInfo& seq, Tile* t) {
  t->any = false;
  for (int r = 0; r < t->rows; ++r) {
    const KeyRange kr =
        visible_keys(t->i0 + r, seq.len_q, seq.len_k, p.window_left, p.window_right);
    t->lo[r] = std::max(kr.lo, t->j0);
    t->hi[r] = std::min(kr.hi, t->j0 + t->cols);
    t->any |= t->lo[r] < t->hi[r];
  }
}

// The mask's rows of sequence b's query block qb, and the tile they make with key block kb.
Tile& tile_at(const AttentionParams& p, const SequenceInfo& seq, int qb, int kb, Tile* t) {
  t->i0 = qb * p.block_m;
  t->rows = std::min(p.block_m, seq.len_q - t->i0);
  t->j0 = kb * p.block_n;
  t->cols = std::min(p.block_n, seq.len_k - t->j0);
  clip_tile(p, seq, t);
  return *t;
}

// ---- loads, stores, scores ----------------------------------------------------------------------

// `rows` rows of a user tensor (row stride `stride`) as dense fp32 (rows, d).
void load_rows(const void* src, DType dtype, int64_t offset, int64_t stride, int rows, int d,
               float* dst) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < d; ++c)
      dst[int64_t{r} * d + c] = load_as_float(src, offset + r * stride + c, dtype);
}

void store_rows(const float* src, double factor, int rows, int d, void* dst, DType dtype,
                int64_t offset, int64_t stride) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < d; ++c)
      store_from_float(dst, offset + r * stride + c, dtype,
                       static_cast<float>(src[int64_t{r} * d + c] * factor));
}

float dot(const float* a, const float* b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

void axpy(float w, const float* x, float* y, int d) {
  for (int c = 0; c < d; ++c) y[c] += w * x[c];
}

// Score of (row, key j) from its raw dot product, in attention.h's order: scale, softcap, ALiBi
// (modified_score). *dcap receives the softcap chain-rule factor 1 − tanh² (1 when softcap is off).
float score(const AttentionParams& p, const HeadLocation& hd, float raw, int row, int j,
            float* dcap) {
  return modified_score(
      raw * p.scale, p.softcap, p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f,
      p.alibi_slopes != nullptr ? alibi_bias(hd.slope, row, j, hd.seq.len_q, hd.seq.len_k) : 0.0f,
      dcap);
}

// Dropout multiplier of (row, j): `keep` or 0.
float dropout_factor(const AttentionParams& p, const HeadLocation& hd, int row, int j, float keep) {
  if (p.dropout_p == 0.0f) return keep;
  return dropout_keep(p.seed, p.offset, hd.bh, static_cast<uint32_t>(row),
                      static_cast<uint32_t>(j), p.dropout_p)
             ? keep
             : 0.0f;
}

// ---- per-thread scratch ---------------------------------------------------------------------------

// Tiles of one thread, sized for the largest (query block, key block) pair of the call.
struct alignas(64) Scratch {  // a line of its own: tiles_run counts per tile
  std::vector<float> q, dout, acc;   // (rows, d)
  std::vector<float> k, v, dk, dv;   // (cols, d)
  std::vector<float> m, l, lse, delta;  // (rows)
  std::vector<float> s;              // (cols)
  std::vector<char> seen;            // (rows): the row met a key
  Tile tile;
  int64_t tiles_run = 0;  // tiles this thread computed (the entry points' *tiles_run)

  Scratch(int rows, int cols, int d)
      : q(size_t(rows) * d), dout(size_t(rows) * d), acc(size_t(rows) * d), k(size_t(cols) * d),
        v(size_t(cols) * d), dk(size_t(cols) * d), dv(size_t(cols) * d), m(rows), l(rows),
        lse(rows), delta(rows), s(cols), seen(rows) {
    tile.lo.resize(rows);
    tile.hi.resize(rows);
  }
};

// One Scratch per thread; false when an allocation fails.
bool allocate_scratch(const AttentionParams& p, int threads, std::vector<Scratch>* out) {
  // No block is longer than the longest sequence.
  const int rows = static_cast<int>(std::min<int64_t>(p.block_m, std::max(p.seqlen_q, 1)));
  const int cols = static_cast<int>(std::min<int64_t>(p.block_n, std::max(p.seqlen_k, 1)));
  try {
    out->reserve(threads);
    for (int t = 0; t < threads; ++t) out->emplace_back(rows, cols, p.head_dim);
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

// ---- tasks --------------------------------------------------------------------------------------

// One task per (sequence, head, block) for the blocks each sequence has, counted from the
// sequence's own length (varlen costs its tokens, not max_seqlen).
struct Task {
  int b, h, block;
};

bool make_tasks(const AttentionParams& p, int heads, bool query_side, std::vector<Task>* tasks) {
  try {
    for (int b = 0; b < p.batch; ++b) {
      const SequenceInfo seq = sequence_info(p, b);
      const int64_t blocks = query_side ? ceil_div(seq.len_q, p.block_m) : ceil_div(seq.len_k, p.block_n);
      for (int h = 0; h < heads; ++h)
        for (int64_t blk = 0; blk < blocks; ++blk) tasks->push_back({b, h, static_cast<int>(blk)});
    }
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

int thread_count(size_t tasks) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(),
                                                                  static_cast<int64_t>(tasks))));
}

// Calls visit(tile) for each key tile of query block qb that the mask turns on and that holds a
// visible key, with its K and V rows loaded into sc->k and sc->v; counted in sc->tiles_run.
template <typename Visit>
void for_each_key_tile(const AttentionParams& p, const HeadLocation& hd, int qb, Scratch* sc, Visit visit) {
  const int key_blocks = static_cast<int>(ceil_div(hd.seq.len_k, p.block_n));
  for (int kb = 0; kb < key_blocks; ++kb) {
    if (!block_on(p, hd.b, hd.h, qb, kb)) continue;
    const Tile& t = tile_at(p, hd.seq, qb, kb, &sc->tile);
    if (!t.any) continue;
    ++sc->tiles_run;
    load_rows(p.k, p.dtype, hd.k + t.j0 * p.k_row_stride, p.k_row_stride, t.cols, p.head_dim, sc->k.data());
    load_rows(p.v, p.dtype, hd.v + t.j0 * p.v_row_stride, p.v_row_stride, t.cols, p.head_dim, sc->v.data());
    visit(t);
  }
}

// ---- forward ------------------------------------------------------------------------------------

void forward_block(const AttentionParams& p, const Task& task, Scratch* sc) {
  const HeadLocation hd = locate_head(p, task.b, task.h);
  const int d = p.head_dim, qb = task.block;
  const int i0 = qb * p.block_m, rows = std::min(p.block_m, hd.seq.len_q - i0);
  load_rows(p.q, p.dtype, hd.q + i0 * p.q_row_stride, p.q_row_stride, rows, d, sc->q.data());
  std::fill(sc->acc.begin(), sc->acc.begin() + int64_t{rows} * d, 0.0f);
  std::fill(sc->m.begin(), sc->m.begin() + rows, -kInf);
  std::fill(sc->l.begin(), sc->l.begin() + rows, 0.0f);
  std::fill(sc->seen.begin(), sc->seen.begin() + rows, 0);

  for_each_key_tile(p, hd, qb, sc, [&](const Tile& t) {
    for (int r = 0; r < rows; ++r) {
      if (t.lo[r] >= t.hi[r]) continue;
      sc->seen[r] = 1;
      const int row = i0 + r;
      const float* qr = &sc->q[int64_t{r} * d];
      float mx = -kInf, unused_dcap;
      for (int j = t.lo[r]; j < t.hi[r]; ++j) {
        const float raw = dot(qr, &sc->k[int64_t{j - t.j0} * d], d);
        sc->s[j - t.j0] = score(p, hd, raw, row, j, &unused_dcap);
        mx = std::max(mx, sc->s[j - t.j0]);
      }
      const float m_new = std::max(sc->m[r], mx);
      const float m_use = softmax_base(m_new);
      const float alpha = std::exp(sc->m[r] - m_use);
      float* ar = &sc->acc[int64_t{r} * d];
      if (alpha != 1.0f)
        for (int c = 0; c < d; ++c) ar[c] *= alpha;
      float sum = 0.0f;
      for (int j = t.lo[r]; j < t.hi[r]; ++j) {
        const float e = std::exp(sc->s[j - t.j0] - m_use);
        sum += e;
        axpy(e * dropout_factor(p, hd, row, j, 1.0f), &sc->v[int64_t{j - t.j0} * d], ar, d);
      }
      sc->l[r] = sc->l[r] * alpha + sum;
      sc->m[r] = m_new;
    }
  });

  for (int r = 0; r < rows; ++r) {
    const RowFinish end = finish_row(sc->seen[r] != 0, sc->m[r], sc->l[r], p.dropout_scale);
    store_rows(&sc->acc[int64_t{r} * d], end.factor, 1, d, p.o, p.dtype,
               hd.o + int64_t{i0 + r} * p.o_row_stride, p.o_row_stride);
    p.lse[hd.lse + i0 + r] = end.lse;
  }
}

// ---- backward -----------------------------------------------------------------------------------

// Pass 0: D_i = dO_i·O_i for the rows of one query block.
void delta_block(const AttentionParams& p, const Task& task, float* delta, Scratch* sc) {
  const HeadLocation hd = locate_head(p, task.b, task.h);
  const int d = p.head_dim, i0 = task.block * p.block_m;
  const int rows = std::min(p.block_m, hd.seq.len_q - i0);
  load_rows(p.o, p.dtype, hd.o + i0 * p.o_row_stride, p.o_row_stride, rows, d, sc->q.data());
  load_rows(p.dout, p.dtype, hd.dout + i0 * p.do_row_stride, p.do_row_stride, rows, d,
            sc->dout.data());
  for (int r = 0; r < rows; ++r)
    delta[hd.lse + i0 + r] = dot(&sc->dout[int64_t{r} * d], &sc->q[int64_t{r} * d], d);
}

// Query-side tiles of one block: Q, dO, LSE (+inf for rows that see no key, so P = 0) and D.
void load_query_side(const AttentionParams& p, const HeadLocation& hd, int i0, int rows,
                     const float* delta, Scratch* sc) {
  const int d = p.head_dim;
  load_rows(p.q, p.dtype, hd.q + i0 * p.q_row_stride, p.q_row_stride, rows, d, sc->q.data());
  load_rows(p.dout, p.dtype, hd.dout + i0 * p.do_row_stride, p.do_row_stride, rows, d,
            sc->dout.data());
  for (int r = 0; r < rows; ++r) {
    const float lse = p.lse[hd.lse + i0 + r];
    sc->lse[r] = lse == -kInf ? kInf : lse;
    sc->delta[r] = delta[hd.lse + i0 + r];
  }
}

// P̃ = P·z (for dV) and dS = P ∘ (z·dP − D) · softcap factor (for dK, dQ) of one visible pair;
// q and dout are the row's tiles, k and v the key's.
struct PairGrad {
  float pz, ds;
};

PairGrad pair_grad(const AttentionParams& p, const HeadLocation& hd, int row, int j, const float* q,
                   const float* dout, const float* k, const float* v, float lse, float delta) {
  const int d = p.head_dim;
  float dcap;
  const float s = score(p, hd, dot(q, k, d), row, j, &dcap);
  const float prob = std::exp(s - lse);
  const float z = dropout_factor(p, hd, row, j, p.dropout_scale);
  const float dp = z * dot(dout, v, d);
  return {prob * z, prob * (dp - delta) * dcap};
}

// Pass 1: dK and dV of one key block of kv head task.h, over its group's query heads.
void key_block_backward(const AttentionParams& p, const Task& task, const float* delta,
                        Scratch* sc) {
  const int d = p.head_dim, kvh = task.h, kb = task.block;
  const HeadLocation first = locate_head(p, task.b, kvh * p.head_group);
  const SequenceInfo& seq = first.seq;
  const int j0 = kb * p.block_n, cols = std::min(p.block_n, seq.len_k - j0);
  std::fill(sc->dk.begin(), sc->dk.begin() + int64_t{cols} * d, 0.0f);
  std::fill(sc->dv.begin(), sc->dv.begin() + int64_t{cols} * d, 0.0f);
  bool loaded = false;
  const int query_blocks = static_cast<int>(ceil_div(seq.len_q, p.block_m));
  for (int h = kvh * p.head_group; h < (kvh + 1) * p.head_group; ++h) {
    const HeadLocation hd = locate_head(p, task.b, h);
    for (int qb = 0; qb < query_blocks; ++qb) {
      if (!block_on(p, hd.b, hd.h, qb, kb)) continue;
      const Tile& t = tile_at(p, seq, qb, kb, &sc->tile);
      if (!t.any) continue;
      ++sc->tiles_run;
      if (!loaded) {  // K and V only once some tile needs them
        load_rows(p.k, p.dtype, first.k + j0 * p.k_row_stride, p.k_row_stride, cols, d,
                  sc->k.data());
        load_rows(p.v, p.dtype, first.v + j0 * p.v_row_stride, p.v_row_stride, cols, d,
                  sc->v.data());
        loaded = true;
      }
      load_query_side(p, hd, t.i0, t.rows, delta, sc);
      // Every dK/dV element is summed here alone, over (head, query block, row) in order.
      for (int r = 0; r < t.rows; ++r) {
        const float* qr = &sc->q[int64_t{r} * d];
        const float* dor = &sc->dout[int64_t{r} * d];
        for (int j = t.lo[r]; j < t.hi[r]; ++j) {
          const int c = j - j0;
          const PairGrad g = pair_grad(p, hd, t.i0 + r, j, qr, dor, &sc->k[int64_t{c} * d],
                                       &sc->v[int64_t{c} * d], sc->lse[r], sc->delta[r]);
          axpy(g.pz, dor, &sc->dv[int64_t{c} * d], d);
          axpy(g.ds, qr, &sc->dk[int64_t{c} * d], d);
        }
      }
    }
  }
  store_rows(sc->dk.data(), p.scale, cols, d, p.dk, p.dtype, first.dk + j0 * p.dk_row_stride,
             p.dk_row_stride);
  store_rows(sc->dv.data(), 1.0, cols, d, p.dv, p.dtype, first.dv + j0 * p.dv_row_stride,
             p.dv_row_stride);
}

// Pass 2: dQ of one query block of query head task.h.
void query_block_backward(const AttentionParams& p, const Task& task, const float* delta,
                          Scratch* sc) {
  const HeadLocation hd = locate_head(p, task.b, task.h);
  const int d = p.head_dim, qb = task.block;
  const int i0 = qb * p.block_m, rows = std::min(p.block_m, hd.seq.len_q - i0);
  load_query_side(p, hd, i0, rows, delta, sc);
  std::fill(sc->acc.begin(), sc->acc.begin() + int64_t{rows} * d, 0.0f);
  for_each_key_tile(p, hd, qb, sc, [&](const Tile& t) {
    for (int r = 0; r < rows; ++r) {
      const float* qr = &sc->q[int64_t{r} * d];
      const float* dor = &sc->dout[int64_t{r} * d];
      for (int j = t.lo[r]; j < t.hi[r]; ++j) {
        const float* kj = &sc->k[int64_t{j - t.j0} * d];
        const PairGrad g = pair_grad(p, hd, i0 + r, j, qr, dor, kj, &sc->v[int64_t{j - t.j0} * d],
                                     sc->lse[r], sc->delta[r]);
        axpy(g.ds, kj, &sc->acc[int64_t{r} * d], d);
      }
    }
  });
  store_rows(sc->acc.data(), p.scale, rows, d, p.dq, p.dtype, hd.dq + i0 * p.dq_row_stride,
             p.dq_row_stride);
}

// The tiles every thread computed, where the caller asked for the count.
void report_tiles(const std::vector<Scratch>& scratch, int64_t* tiles_run) {
  if (tiles_run == nullptr) return;
  *tiles_run = 0;
  for (const Scratch& sc : scratch) *tiles_run += sc.tiles_run;
}

}  // namespace

// ---- entry points -------------------------------------------------------------------------------

Status block_sparse_flash_forward(const AttentionParams& p, int64_t* tiles_run) {
  if (tiles_run != nullptr) *tiles_run = 0;
  std::vector<Task> tasks;
  if (!make_tasks(p, p.heads_q, true, &tasks))
    return Status::out_of_memory("cpu block-sparse forward: task list");
  if (tasks.empty()) return {};
  const int threads = thread_count(tasks.size());
  std::vector<Scratch> scratch;
  if (!allocate_scratch(p, threads, &scratch))
    return Status::out_of_memory("cpu block-sparse forward: per-thread tiles");
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) forward_block(p, tasks[i], &scratch[omp_get_thread_num()]);
  report_tiles(scratch, tiles_run);
  return {};
}

Status block_sparse_flash_backward(const AttentionParams& p, int64_t* tiles_run) {
  if (tiles_run != nullptr) *tiles_run = 0;
  std::vector<Task> q_tasks, k_tasks;
  if (!make_tasks(p, p.heads_q, true, &q_tasks) || !make_tasks(p, p.heads_kv, false, &k_tasks))
    return Status::out_of_memory("cpu block-sparse backward: task lists");
  if (q_tasks.empty() && k_tasks.empty()) return {};
  const int threads = thread_count(std::max(q_tasks.size(), k_tasks.size()));
  std::vector<Scratch> scratch;
  std::vector<float> delta;
  try {
    delta.resize(static_cast<size_t>(p.heads_q) * static_cast<size_t>(p.total_q));
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory("cpu block-sparse backward: D buffer");
  }
  if (!allocate_scratch(p, threads, &scratch))
    return Status::out_of_memory("cpu block-sparse backward: per-thread tiles");
  const int64_t nq = static_cast<int64_t>(q_tasks.size());
  const int64_t nk = static_cast<int64_t>(k_tasks.size());
#pragma omp parallel num_threads(threads)
  {
    Scratch* mine = &scratch[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nq; ++i) delta_block(p, q_tasks[i], delta.data(), mine);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nk; ++i) key_block_backward(p, k_tasks[i], delta.data(), mine);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nq; ++i) query_block_backward(p, q_tasks[i], delta.data(), mine);
  }
  report_tiles(scratch, tiles_run);
  return {};
}

}  // namespace flare::cpu
