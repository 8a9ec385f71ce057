// Memory figures of this process, for the CLI's progress lines and benchmarks.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace ulysses::cli {

// A "Key:   1234 kB" line of /proc/self/status (VmRSS, VmHWM, ...) in bytes; -1 if absent.
inline int64_t proc_status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  }
  return -1;
}

}  // namespace ulysses::cli
