// The bytes of host memory that offloaded checkpoints hold now: the C++ checkpoints' and Python's
// (ulysses.tiled), one count per process (its one piece of process-wide state besides the group
// runtimes, as the host memory it counts is the process's).
#pragma once

#include <cstdint>

namespace ulysses {

int64_t offloaded_bytes();
// Adds `delta` (negative: released) to the count.
void count_offloaded_bytes(int64_t delta);

}  // namespace ulysses
