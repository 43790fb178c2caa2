// test_dist_util.h — running one function per rank of an in-process group, each on its own thread.
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "flare/dist.h"

namespace flare::test {

inline std::vector<std::unique_ptr<dist::Communicator>> in_process_group(int size, int timeout_ms) {
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  const Status s = dist::make_in_process_group(size, {timeout_ms}, &comms);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return comms;
}

// Runs fn(comm) for every rank at once, each on its own thread; returns each rank's status.
inline std::vector<Status> run_ranks(std::vector<std::unique_ptr<dist::Communicator>>& comms,
                                     const std::function<Status(dist::Communicator&)>& fn) {
  std::vector<Status> result(comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r)
    threads.emplace_back([&, r] { result[r] = fn(*comms[r]); });
  for (std::thread& t : threads) t.join();
  return result;
}

}  // namespace flare::test
