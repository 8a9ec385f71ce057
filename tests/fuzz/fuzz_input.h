// Reading a fuzzer's bytes as small integers, and the check that makes a broken invariant a
// crash the fuzzer reports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace ulysses::fuzz {

// Consumes the input front to back; reads past the end give 0.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  // An integer in [lo, hi], mostly small, sometimes anywhere in the range.
  int64_t in(int64_t lo, int64_t hi) {
    const uint8_t b = byte();
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    if (b < 250 || span == 0) return lo + static_cast<int64_t>(b % (span ? span : 256));
    uint64_t wide = 0;
    for (int i = 0; i < 8; ++i) wide = wide << 8 | byte();
    return lo + static_cast<int64_t>(wide % span);
  }
  bool done() const { return pos_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace ulysses::fuzz

// An invariant of the code under test: a violation aborts (the fuzzer's crash signal).
#define FUZZ_CHECK(cond)                                                                \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)
