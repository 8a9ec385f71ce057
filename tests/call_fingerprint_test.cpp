// The call fingerprint as a value: encode/decode round trip, and check_alike naming the first
// differing field with every rank's value (no tensors, no process groups).
#include "plan/call_fingerprint.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

namespace ulysses {
namespace {

CallFingerprint sample() {
  CallFingerprint f;
  f.q_heads = 6, f.kv_heads = 2, f.sp_size = 3, f.layout = 0, f.seq_split = 17;
  f.pipeline_min_bytes = 4096, f.message_bytes = 1024, f.batched = 1;
  TensorFacts q;
  q.given = true, q.sizes = {2, 5, 6, 8}, q.dtype = 6, q.device_type = 0, q.requires_grad = true;
  f.tensors = {q, q, q};
  f.positions = q;
  f.positions.sizes = {2, 5};
  f.causal = true, f.scale = 0.25, f.window = 7, f.softcap = 50.0, f.step_context = true;
  return f;
}

std::string disagreement(const CallFingerprint& a, const CallFingerprint& b) {
  try {
    check_alike({a, b}, {"q", "k", "v"}, "test: ");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(CallFingerprint, DecodeInvertsEncode) {
  const CallFingerprint f = sample();
  const CallFingerprint g = CallFingerprint::decode(f.encode());
  EXPECT_EQ(g.encode(), f.encode());
  EXPECT_EQ(g.window, 7);
  EXPECT_EQ(g.batched, 1);
  EXPECT_EQ(g.softcap, 50.0);
  EXPECT_EQ(g.scale, 0.25);
  EXPECT_EQ(g.positions.sizes, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(disagreement(f, g), "");
}

TEST(CallFingerprint, NamesTheWindowAndEveryRanksValue) {
  CallFingerprint none = sample();
  none.window = 0;
  EXPECT_NE(disagreement(none, sample())
                .find("ranks disagree on window: rank 0 has none, rank 1 "
                      "has 7"),
            std::string::npos)
      << disagreement(none, sample());
}

TEST(CallFingerprint, NamesTheSoftcap) {
  CallFingerprint other = sample();
  other.softcap = 30.0;
  EXPECT_NE(disagreement(sample(), other)
                .find("ranks disagree on softcap: rank 0 has 50, rank 1 "
                      "has 30"),
            std::string::npos)
      << disagreement(sample(), other);
}

TEST(CallFingerprint, NamesTheSinks) {
  CallFingerprint with = sample();
  with.sinks = with.tensors[0];
  with.sinks.sizes = {4};
  EXPECT_EQ(CallFingerprint::decode(with.encode()).sinks.sizes, (std::vector<int64_t>{4}));
  EXPECT_NE(disagreement(sample(), with)
                .find("ranks disagree on whether sinks is given: rank 0 has no, rank 1 has yes"),
            std::string::npos)
      << disagreement(sample(), with);
  CallFingerprint wider = with;
  wider.sinks.sizes = {8};
  EXPECT_NE(disagreement(with, wider).find("ranks disagree on sinks's dim 0"), std::string::npos)
      << disagreement(with, wider);
}

TEST(CallFingerprint, TheSequenceDimMayDiffer) {
  CallFingerprint shorter = sample();
  for (TensorFacts& t : shorter.tensors) t.sizes[1] = 4;
  shorter.positions.sizes[1] = 4;
  EXPECT_EQ(disagreement(sample(), shorter), "");
  shorter.tensors[1].sizes[3] = 4;  // k's head dim differs: named.
  EXPECT_NE(disagreement(sample(), shorter).find("ranks disagree on k's dim 3"), std::string::npos);
}

}  // namespace
}  // namespace ulysses
