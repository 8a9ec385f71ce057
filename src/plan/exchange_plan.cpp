#include "ulysses/exchange_plan.h"

#include <c10/util/Exception.h>

namespace ulysses {
namespace {

const std::vector<Range>& ranges_of(const HeadPartition& p, Heads h) {
  return h == Heads::kQuery ? p.q_ranges() : p.kv_ranges();
}

// True when two blocks of one tensor cover common elements.
bool any_overlap(const std::vector<ExchangeBlock>& blocks) {
  for (size_t a = 0; a < blocks.size(); ++a) {
    for (size_t b = a + 1; b < blocks.size(); ++b) {
      const ExchangeBlock &x = blocks[a], &y = blocks[b];
      if (x.tensor == y.tensor && x.tokens.begin < y.tokens.end && y.tokens.begin < x.tokens.end &&
          x.heads.begin < y.heads.end && y.heads.begin < x.heads.end) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace

bool ExchangeBlock::operator==(const ExchangeBlock& o) const {
  return peer == o.peer && tensor == o.tensor && tokens == o.tokens && heads == o.heads &&
         offset == o.offset && numel == o.numel;
}

ExchangePlan ExchangePlan::seq_to_heads(const HeadPartition& heads, const SequencePartition& seq,
                                        int64_t rank, const std::vector<Heads>& tensor_heads,
                                        const std::vector<int64_t>& elements) {
  const int64_t P = heads.sp_size();
  TORCH_CHECK_VALUE(
      seq.sp_size() == P && rank >= 0 && rank < P && tensor_heads.size() == elements.size(),
      "ExchangePlan: ", heads, " and ", seq, " on rank ", rank, " with ", tensor_heads.size(),
      " tensors' head kinds and ", elements.size(), " element counts");
  ExchangePlan p;
  p.send_splits_.assign(P, 0);
  p.recv_splits_.assign(P, 0);
  const int64_t S_me = seq.length(rank);
  for (size_t t = 0; t < tensor_heads.size(); ++t) {
    const auto& R = ranges_of(heads, tensor_heads[t]);
    p.in_.push_back({S_me, tensor_heads[t] == Heads::kQuery ? heads.q_heads() : heads.kv_heads()});
    p.out_.push_back({seq.seq_len(), R[rank].size()});
    for (const Range& r : R) p.total_ += seq.seq_len() * r.size() * elements[t];
  }
  int64_t send_off = 0, recv_off = 0;
  for (int64_t j = 0; j < P; ++j) {
    for (size_t t = 0; t < tensor_heads.size(); ++t) {
      const auto& R = ranges_of(heads, tensor_heads[t]);
      const auto tt = static_cast<int64_t>(t);
      const int64_t n_send = S_me * R[j].size() * elements[t];
      const int64_t n_recv = seq.length(j) * R[rank].size() * elements[t];
      p.send_.push_back({j, tt, {0, S_me}, R[j], send_off, n_send});
      p.recv_.push_back({j, tt, seq.range(j), {0, R[rank].size()}, recv_off, n_recv});
      send_off += n_send;
      recv_off += n_recv;
      p.send_splits_[j] += n_send;
      p.recv_splits_[j] += n_recv;
    }
  }
  p.sums_ = any_overlap(p.recv_);
  return p;
}

ExchangePlan ExchangePlan::reversed() const {
  ExchangePlan p;
  p.send_splits_ = recv_splits_;
  p.recv_splits_ = send_splits_;
  p.send_ = recv_;
  p.recv_ = send_;
  p.in_ = out_;
  p.out_ = in_;
  p.sums_ = any_overlap(p.recv_);
  p.total_ = total_;
  return p;
}

bool ExchangePlan::operator==(const ExchangePlan& o) const {
  return send_splits_ == o.send_splits_ && recv_splits_ == o.recv_splits_ && send_ == o.send_ &&
         recv_ == o.recv_ && in_ == o.in_ && out_ == o.out_ && sums_ == o.sums_ &&
         total_ == o.total_;
}

std::ostream& operator<<(std::ostream& os, const ExchangePlan& p) {
  auto blocks = [&](const char* what, const std::vector<ExchangeBlock>& bs) {
    os << what << "=[";
    for (size_t i = 0; i < bs.size(); ++i) {
      const ExchangeBlock& b = bs[i];
      os << (i ? ", " : "") << "peer " << b.peer << " t" << b.tensor << " tokens" << b.tokens
         << " heads" << b.heads << " @" << b.offset << "+" << b.numel;
    }
    os << "]";
  };
  os << "ExchangePlan(";
  blocks("send", p.send());
  os << ", ";
  blocks("recv", p.recv());
  return os << (p.sums_received() ? ", sums received" : "") << ")";
}

}  // namespace ulysses
