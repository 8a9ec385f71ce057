// Training data for `ulysses train`: a synthetic long-range retrieval task and plain text.
// Both are deterministic functions of (seed, split, step, sequence index), so a resumed run
// sees exactly the batches of an uninterrupted one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ulysses/sharding.h"

namespace ulysses::cli {

// Key-value retrieval: `pairs` (key, value) tokens at the start of the sequence, filler noise,
// then the pairs again at the end, in the same order or (shuffle) a random one:
//   [BOS k1 v1 ... kn vn  f f f ... f  kπ1 vπ1 ... kπn vπn]
// Scored targets are the values after each repeated key (and, in order, the keys after the
// first, which makes the copying circuit learnable in a few hundred steps). Answering needs
// attention from the last shard back to the first.
class RetrievalTask {
 public:
  RetrievalTask(int64_t seq_len, int64_t pairs, bool shuffle, uint64_t seed);
  // Sequences [first, first + count) of `step` in `split` (0: train, 1: held-out), [count, S].
  TokenBatch batch(int split, int64_t step, int64_t first, int64_t count) const;
  int64_t vocab() const { return kValueBase + kValues; }

  static constexpr int64_t kBos = 0, kFillerBase = 1, kFillers = 31;
  static constexpr int64_t kKeyBase = 32, kKeys = 64, kValueBase = 96, kValues = 64;

 private:
  int64_t seq_len_, pairs_;
  bool shuffle_;  // Query pairs in random order (harder) instead of the original order.
  uint64_t seed_;
};

// Byte-level language modelling on a text file: windows of seq_len bytes at random offsets.
class TextData {
 public:
  TextData(const std::string& path, int64_t seq_len, uint64_t seed);
  TokenBatch batch(int split, int64_t step, int64_t first, int64_t count) const;
  int64_t vocab() const { return 256; }

 private:
  std::vector<uint8_t> bytes_;
  int64_t seq_len_;
  uint64_t seed_;
};

// The training data, whichever source was chosen: the text file at `path`, or ("") the
// retrieval task.
class Data {
 public:
  Data(const std::string& path, int64_t seq_len, int64_t pairs, bool shuffle, uint64_t seed) {
    if (path.empty()) {
      retrieval_ = std::make_unique<RetrievalTask>(seq_len, pairs, shuffle, seed);
    } else {
      text_ = std::make_unique<TextData>(path, seq_len, seed);
    }
  }
  int64_t vocab() const { return retrieval_ ? retrieval_->vocab() : text_->vocab(); }
  TokenBatch batch(int split, int64_t step, int64_t first, int64_t count) const {
    return retrieval_ ? retrieval_->batch(split, step, first, count)
                      : text_->batch(split, step, first, count);
  }
  bool is_retrieval() const { return retrieval_ != nullptr; }

 private:
  std::unique_ptr<RetrievalTask> retrieval_;
  std::unique_ptr<TextData> text_;
};

}  // namespace ulysses::cli
