// test_cpu_varlen_cost.cpp — the CPU flash backend's work follows the tokens of a varlen batch,
// not its max_seqlen.
//
// On the CPU, cu_seqlens can be read, so max_seqlen is only an upper bound (validated, never
// used to size the work). A grid sized by it made one token with max_seqlen 2^24 cost 17 ms
// forward and 55 ms backward instead of 0.08 / 0.05 ms. Timing bounds would be guesses, so the
// tests count what the cost is made of: the tasks the backend runs (cpu::flash_tasks_run). Each
// task covers at least one query row of one head (forward; the backward's D and dQ passes) or one
// key of one kv head (the backward's dK/dV pass), and every non-empty sequence needs at least one
// per head and pass, which bounds the count from both sides by the tokens present. The outputs
// must not depend on max_seqlen at all: the same problem with max_seqlen at the longest sequence
// and at 2^24 gives the same bits.
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/flash_tasks.h"
#include "test_util.h"

namespace flare::test {
namespace {

struct Counts {
  int64_t forward = 0, backward = 0;
};

// Runs forward and backward on freshly poisoned outputs; returns the tasks each ran.
Counts run(Problem& pr) {
  Counts c;
  pr.o.poison();
  pr.lse.poison();
  pr.dq.poison();
  pr.dk.poison();
  pr.dv.poison();
  const int64_t t0 = cpu::flash_tasks_run.load();
  Status s = attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                               pr.options, pr.varlen);
  EXPECT_TRUE(s.ok()) << s.to_string();
  const int64_t t1 = cpu::flash_tasks_run.load();
  s = attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                         pr.dq.view, pr.dk.view, pr.dv.view, pr.options, pr.varlen);
  EXPECT_TRUE(s.ok()) << s.to_string();
  c.forward = t1 - t0;
  c.backward = cpu::flash_tasks_run.load() - t1;
  return c;
}

struct Tokens {
  int64_t q = 0, k = 0;                 // tokens present
  int64_t nonempty_q = 0, nonempty_k = 0;  // sequences with at least one
};

Tokens tokens(const ProblemSpec& spec) {
  Tokens t;
  for (size_t b = 0; b < spec.varlen_q.size(); ++b) {
    t.q += spec.varlen_q[b];
    t.k += spec.varlen_k[b];
    t.nonempty_q += spec.varlen_q[b] > 0;
    t.nonempty_k += spec.varlen_k[b] > 0;
  }
  return t;
}

void expect_counts_follow_tokens(const Counts& c, const ProblemSpec& spec) {
  const Tokens t = tokens(spec);
  const int64_t hq = spec.heads_q, hkv = spec.heads_kv;
  EXPECT_GE(c.forward, hq * t.nonempty_q);
  EXPECT_LE(c.forward, hq * t.q);
  EXPECT_GE(c.backward, 2 * hq * t.nonempty_q + hkv * t.nonempty_k);
  EXPECT_LE(c.backward, 2 * hq * t.q + hkv * t.k);
}

std::vector<unsigned char> outputs(const Problem& pr) {
  std::vector<unsigned char> all;
  for (const HostTensor* t : {&pr.o, &pr.lse, &pr.dq, &pr.dk, &pr.dv})
    all.insert(all.end(), t->bytes.begin(), t->bytes.end());
  return all;
}

// The problem with its longest sequence as max_seqlen, then with 2^24: the same tasks, the same
// bits, both within the token bounds.
void check(ProblemSpec spec) {
  spec.seed = test_seed();
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  const Counts tight = run(pr);
  const std::vector<unsigned char> tight_outputs = outputs(pr);
  expect_counts_follow_tokens(tight, spec);

  pr.varlen.max_seqlen_q = pr.varlen.max_seqlen_k = 1 << 24;
  const Counts loose = run(pr);
  expect_counts_follow_tokens(loose, spec);
  EXPECT_EQ(loose.forward, tight.forward);
  EXPECT_EQ(loose.backward, tight.backward);
  EXPECT_TRUE(outputs(pr) == tight_outputs) << "outputs depend on max_seqlen";
}

TEST(CpuVarlenCost, OneTokenWithMaxSeqlen2To24) {
  ProblemSpec spec;
  spec.varlen_q = {1};
  spec.varlen_k = {1};
  spec.heads_q = 2;
  spec.heads_kv = 1;
  spec.head_dim = 64;
  check(spec);
}

TEST(CpuVarlenCost, SequencesOfManyLengthsWithEmptyOnes) {
  ProblemSpec spec;
  spec.varlen_q = {5, 0, 300, 1, 130};
  spec.varlen_k = {7, 3, 0, 200, 129};
  spec.heads_q = 4;
  spec.heads_kv = 2;
  spec.head_dim = 40;
  spec.options.causal = true;
  check(spec);
}

TEST(CpuVarlenCost, MaxSeqlenIsStillValidated) {
  ProblemSpec spec;
  spec.varlen_q = {3, 1};
  spec.varlen_k = {2, 4};
  spec.head_dim = 16;
  Problem pr = make_problem(spec);
  pr.varlen.max_seqlen_k = 3;  // sequence 1 has 4 keys
  const Status s = attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                     pr.options, pr.varlen);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.to_string().find("max_seqlen_k"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace flare::test
