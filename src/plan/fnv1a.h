// FNV-1a, 64 bits: the one hash the library and its tools use to compare bytes cheaply (round
// purposes and given splits in an agreement, checkpoint files). Not cryptographic. Pure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ulysses {

class Fnv1a {
 public:
  static constexpr uint64_t kOffsetBasis = 14695981039346656037ull;
  static constexpr uint64_t kPrime = 1099511628211ull;
  Fnv1a() = default;
  // Another offset basis (only to check hashes made with one; FNV-1a's is kOffsetBasis).
  explicit Fnv1a(uint64_t offset_basis) : h_(offset_basis) {}
  // Hashes `n` more bytes at `data`.
  Fnv1a& add(const void* data, size_t n) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ bytes[i]) * kPrime;
    return *this;
  }
  Fnv1a& add(const std::string& text) { return add(text.data(), text.size()); }
  // Each value's 8 bytes, least significant first (the same on every platform).
  Fnv1a& add(const std::vector<int64_t>& values) {
    for (int64_t v : values) {
      for (int byte = 0; byte < 8; ++byte) {
        const auto b = static_cast<unsigned char>((static_cast<uint64_t>(v) >> (8 * byte)) & 0xff);
        add(&b, 1);
      }
    }
    return *this;
  }
  uint64_t value() const { return h_; }
  // The hash as a non-negative int64 (what an agreement round carries).
  int64_t non_negative() const { return static_cast<int64_t>(h_ >> 1); }

 private:
  uint64_t h_ = kOffsetBasis;
};

}  // namespace ulysses
