#include "train_data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <fstream>
#include <iterator>

namespace ulysses::cli {
namespace {

// A generator for one sequence: distinct streams for every (seed, split, step, index).
at::Generator sequence_generator(uint64_t seed, int split, int64_t step, int64_t index) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull;
  for (uint64_t v :
       {static_cast<uint64_t>(split), static_cast<uint64_t>(step), static_cast<uint64_t>(index)}) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  }
  return at::make_generator<at::CPUGeneratorImpl>(h);
}

}  // namespace

RetrievalTask::RetrievalTask(int64_t seq_len, int64_t pairs, bool shuffle, uint64_t seed)
    : seq_len_(seq_len), pairs_(pairs), shuffle_(shuffle), seed_(seed) {
  TORCH_CHECK_VALUE(pairs >= 1 && pairs <= kKeys, "retrieval task: pairs must be in [1, ", kKeys,
                    "]; got ", pairs);
  TORCH_CHECK_VALUE(seq_len >= 4 * pairs + 1, "retrieval task: seq-len (", seq_len,
                    ") must be >= 4 * pairs + 1 = ", 4 * pairs + 1);
}

TokenBatch RetrievalTask::batch(int split, int64_t step, int64_t first, int64_t count) const {
  at::Tensor ids = at::empty({count, seq_len_}, at::kLong);
  at::Tensor labels = at::full({count, seq_len_}, kIgnoreIndex, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    auto gen = sequence_generator(seed_, split, step, first + i);
    at::Tensor keys = at::randperm(kKeys, gen, at::kLong).narrow(0, 0, pairs_) + kKeyBase;
    at::Tensor values = at::randint(kValueBase, kValueBase + kValues, {pairs_}, gen, at::kLong);
    at::Tensor order =
        shuffle_ ? at::randperm(pairs_, gen, at::kLong) : at::arange(pairs_, at::kLong);
    at::Tensor row = at::randint(kFillerBase, kFillerBase + kFillers, {seq_len_}, gen, at::kLong);
    row[0] = kBos;
    row.narrow(0, 1, 2 * pairs_).view({pairs_, 2}).copy_(at::stack({keys, values}, 1));
    const int64_t tail = seq_len_ - 2 * pairs_;
    row.narrow(0, tail, 2 * pairs_)
        .view({pairs_, 2})
        .copy_(at::stack({keys.index_select(0, order), values.index_select(0, order)}, 1));
    ids[i] = row;
    // Label the answers: the value tokens of the query region (shifted later, so the key's
    // position predicts them). In order, the keys after the first are predictable too.
    at::Tensor query = labels[i].narrow(0, tail, 2 * pairs_).view({pairs_, 2});
    query.select(1, 1).copy_(values.index_select(0, order));
    if (!shuffle_) query.select(1, 0).narrow(0, 1, pairs_ - 1).copy_(keys.narrow(0, 1, pairs_ - 1));
  }
  return {ids, labels, at::Tensor()};
}

TextData::TextData(const std::string& path, int64_t seq_len, uint64_t seed)
    : seq_len_(seq_len), seed_(seed) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK_VALUE(in.good(), "train: cannot read --data file '", path, "'");
  bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  // The held-out tenth must hold a whole sequence of its own, never bytes the model trains on.
  TORCH_CHECK_VALUE(static_cast<int64_t>(bytes_.size()) >= 10 * (seq_len + 1),
                    "train: --data file '", path, "' has ", bytes_.size(),
                    " bytes; need at least 10 x (seq-len + 1) = ", 10 * (seq_len + 1),
                    " so that the held-out last tenth holds a whole sequence (use a larger file "
                    "or a smaller --seq-len)");
}

TokenBatch TextData::batch(int split, int64_t step, int64_t first, int64_t count) const {
  // The last tenth of the file is held out.
  const int64_t n = static_cast<int64_t>(bytes_.size());
  const int64_t boundary =
      n * 9 / 10;  // Training windows end before it, held-out ones start at it.
  const int64_t lo = split == 0 ? 0 : boundary;
  const int64_t hi = split == 0 ? boundary - seq_len_ - 1 : n - seq_len_ - 1;
  at::Tensor ids = at::empty({count, seq_len_}, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    auto gen = sequence_generator(seed_, split, step, first + i);
    const int64_t offset =
        lo + at::randint(0, std::max<int64_t>(1, hi - lo + 1), {1}, gen, at::kLong).item<int64_t>();
    auto* p = ids[i].data_ptr<int64_t>();
    for (int64_t j = 0; j < seq_len_; ++j) p[j] = bytes_[offset + j];
  }
  return {ids, ids, at::Tensor()};
}

}  // namespace ulysses::cli
