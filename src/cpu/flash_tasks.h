// flash_tasks.h — a count of the tasks the CPU flash backend runs, for tests.
//
// The backend splits each pass into units of work of one (sequence, head, block of rows or keys)
// (the backward's one-pass mode runs a whole head group's units in one thread task, and counts
// the same units as its two-pass mode), and the number it runs is the cost that must follow the
// tokens present: a varlen call's max_seqlen is
// only an upper bound, and a grid sized by it would cost time in proportion to it (one token
// with max_seqlen 2^24 took 17 ms forward). Tests read this counter around a call and check the
// number against the sequence lengths, an exact property where a timing bound would be a guess.
// Every compiled instruction-set level counts into the same variable (it lives outside their
// namespaces); concurrent calls add up.
#pragma once

#include <atomic>
#include <cstdint>

namespace flare::cpu {

inline std::atomic<int64_t> flash_tasks_run{0};

}  // namespace flare::cpu
