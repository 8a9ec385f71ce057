// scatter_projected and gather_projected against single-rank references in fp64, forward and
// backward, over uneven sequences and heads, GQA with replicated kv heads, batches, biases and
// slabs small enough that every transfer is many messages.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "testing.h"
#include "ulysses/all_to_all.h"

namespace ulysses {
namespace {

using testing::expect_ranks_fail_alike;
using testing::expect_ranks_succeed;
using testing::rel_error;
using testing::run_ranks;
using testing::seeded_randn;
using testing::where;

struct Case {
  int P;
  int64_t hq, hkv, S;
  int64_t B = 2, E = 12, D = 4;
  int64_t message_bytes = 96;  // A few tokens per message.
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "P" << c.P << "_q" << c.hq << "_kv" << c.hkv << "_S" << c.S << "_B" << c.B << "_messages"
     << c.message_bytes;
  return os.str();
}
std::string case_name(const ::testing::TestParamInfo<Case>& info) { return describe(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

Group with_messages(const Group& g, int64_t bytes) {
  GroupOptions options = g.options();
  options.message_bytes = bytes;
  return g.with_options(options);
}

// Sum over ranks of `t` (a partial gradient of a shared weight).
at::Tensor summed(const Group& g, const at::Tensor& t) {
  at::Tensor s = t.clone();
  g.all_reduce_sum(s);
  return s;
}

constexpr double kTol = 1e-5;  // fp32 against fp64 on these sizes.

class ProjectedExchange : public ::testing::TestWithParam<Case> {};

// q, k (no bias) and v projected and scattered: outputs, dx, dW and db as the reference's.
TEST_P(ProjectedExchange, ScatterMatchesReference) {
  const Case c = GetParam();
  expect_ranks_succeed(c.P, [&](Group& world) {
    const Group g = with_messages(world, c.message_bytes);
    const int me = g.rank();
    const auto heads = HeadPartition::make(c.hq, c.hkv, c.P);
    const auto seq = SequencePartition::even(c.S, c.P);
    const Range mine = seq.range(me);
    const std::vector<Heads> kinds{Heads::kQuery, Heads::kKeyValue, Heads::kKeyValue};
    const at::Tensor X = seeded_randn({c.B, c.S, c.E}, 1).to(at::kDouble);
    std::vector<at::Tensor> W, bias;
    for (size_t t = 0; t < kinds.size(); ++t) {
      const int64_t H = kinds[t] == Heads::kQuery ? c.hq : c.hkv;
      W.push_back(seeded_randn({H * c.D, c.E}, 10 + t).to(at::kDouble));
      bias.push_back(t == 1 ? at::Tensor() : seeded_randn({H * c.D}, 20 + t).to(at::kDouble));
    }
    // Cotangent of rank r's output t: its own values (replicated kv heads differ by rank).
    auto cotangent = [&](int r, size_t t) {
      const Range R = kinds[t] == Heads::kQuery ? heads.q_ranges()[r] : heads.kv_ranges()[r];
      return seeded_randn({c.B, c.S, R.size(), c.D}, 100 + 10 * r + t).to(at::kDouble);
    };
    // Reference: every rank's loss term from the full X, in fp64.
    const at::Tensor Xr = X.clone().requires_grad_(true);
    std::vector<at::Tensor> Wr, br;
    for (size_t t = 0; t < kinds.size(); ++t) {
      Wr.push_back(W[t].clone().requires_grad_(true));
      br.push_back(bias[t].defined() ? bias[t].clone().requires_grad_(true) : at::Tensor());
    }
    at::Tensor loss_ref = at::zeros({}, at::kDouble);
    std::vector<at::Tensor> y_ref;
    for (int r = 0; r < c.P; ++r) {
      for (size_t t = 0; t < kinds.size(); ++t) {
        const Range R = kinds[t] == Heads::kQuery ? heads.q_ranges()[r] : heads.kv_ranges()[r];
        const at::Tensor full = at::linear(Xr, Wr[t], br[t]).view({c.B, c.S, -1, c.D});
        const at::Tensor y = full.narrow(2, R.begin, R.size());
        if (r == me) y_ref.push_back(y.detach());
        loss_ref = loss_ref + (y * cotangent(r, t)).sum();
      }
    }
    loss_ref.backward();
    // Ours, in fp32.
    const at::Tensor x =
        X.narrow(1, mine.begin, mine.size()).to(at::kFloat).contiguous().requires_grad_(true);
    std::vector<HeadProjection> projections;
    for (size_t t = 0; t < kinds.size(); ++t) {
      projections.push_back({W[t].to(at::kFloat).requires_grad_(true),
                             bias[t].defined() ? c10::optional<at::Tensor>(
                                                     bias[t].to(at::kFloat).requires_grad_(true))
                                               : c10::nullopt,
                             kinds[t]});
    }
    const Sharding sharding = agree_projection_plan(g, heads, x, projections);
    EXPECT_EQ(sharding.seq, seq);
    const auto ys = scatter_projected(x, projections, sharding, g);
    at::Tensor loss = at::zeros({});
    for (size_t t = 0; t < ys.size(); ++t) {
      EXPECT_LT(rel_error(ys[t].to(at::kDouble), y_ref[t]), kTol)
          << "output " << t << where(g, ys[t]);
      loss = loss + (ys[t] * cotangent(me, t).to(at::kFloat)).sum();
    }
    loss.backward();
    EXPECT_LT(rel_error(x.grad().to(at::kDouble), Xr.grad().narrow(1, mine.begin, mine.size())),
              kTol)
        << "dx" << where(g, x);
    for (size_t t = 0; t < kinds.size(); ++t) {
      EXPECT_LT(rel_error(summed(g, projections[t].weight.grad()).to(at::kDouble), Wr[t].grad()),
                kTol)
          << "dW " << t << where(g, x);
      if (bias[t].defined()) {
        EXPECT_LT(rel_error(summed(g, projections[t].bias->grad()).to(at::kDouble), br[t].grad()),
                  kTol)
            << "db " << t << where(g, x);
      }
    }
  });
}

// o gathered and projected: the output, dy and dW as the reference's.
TEST_P(ProjectedExchange, GatherMatchesReference) {
  const Case c = GetParam();
  expect_ranks_succeed(c.P, [&](Group& world) {
    const Group g = with_messages(world, c.message_bytes);
    const int me = g.rank();
    const auto heads = HeadPartition::make(c.hq, c.hkv, c.P);
    const auto seq = SequencePartition::even(c.S, c.P);
    const Range mine = seq.range(me), R = heads.q_ranges()[me];
    const at::Tensor O = seeded_randn({c.B, c.S, c.hq, c.D}, 3).to(at::kDouble);
    const at::Tensor W = seeded_randn({c.E, c.hq * c.D}, 4).to(at::kDouble);
    const at::Tensor G = seeded_randn({c.B, c.S, c.E}, 5).to(at::kDouble);
    const at::Tensor Or = O.clone().requires_grad_(true), Wr = W.clone().requires_grad_(true);
    const at::Tensor out_ref = at::linear(Or.flatten(2), Wr);
    (out_ref * G).sum().backward();

    const at::Tensor y =
        O.narrow(2, R.begin, R.size()).to(at::kFloat).contiguous().requires_grad_(true);
    const at::Tensor w = W.to(at::kFloat).requires_grad_(true);
    const at::Tensor x_stand_in = at::zeros({c.B, mine.size(), c.E});
    const Sharding sharding = agree_projection_plan(
        g, heads, x_stand_in, {{at::zeros({c.hq * c.D, c.E}), c10::nullopt, Heads::kQuery}});
    const at::Tensor out = gather_projected(y, w, sharding, g);
    EXPECT_LT(rel_error(out.to(at::kDouble), out_ref.detach().narrow(1, mine.begin, mine.size())),
              kTol)
        << where(g, out);
    (out * G.narrow(1, mine.begin, mine.size()).to(at::kFloat)).sum().backward();
    EXPECT_LT(rel_error(y.grad().to(at::kDouble), Or.grad().narrow(2, R.begin, R.size())), kTol)
        << "dy" << where(g, y);
    EXPECT_LT(rel_error(summed(g, w.grad()).to(at::kDouble), Wr.grad()), kTol)
        << "dW" << where(g, w);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ProjectedExchange,
    ::testing::Values(Case{2, 4, 4, 16}, Case{2, 5, 5, 13},  // uneven heads and tokens
                      Case{3, 6, 3, 17, 1},                  // GQA, uneven tokens, B = 1
                      Case{4, 8, 2, 16},                     // kv heads replicated (Hkv < P)
                      Case{3, 7, 1, 11, 2, 12, 4, 1 << 20},  // MQA, one message per peer
                      Case{1, 4, 2, 8}),                     // no peers: projections alone
    case_name);

// A wrong weight on one rank only: the same error on every rank, before any data moves.
TEST(ProjectedExchangeErrors, OneRanksWeightIsWrong) {
  auto errors = run_ranks(2, [](Group& g) {
    const at::Tensor x = at::zeros({1, 4, 8});
    const at::Tensor w = at::zeros({g.rank() == 1 ? 13 : 16, 8});
    agree_projection_plan(g, HeadPartition::make(4, 4, 2), x, {{w, c10::nullopt, Heads::kQuery}});
  });
  expect_ranks_fail_alike(errors,
                          "projection 0's weight must be [4 query heads x D, 8]; got [13, 8]");
}

// The ops' own checks, against an agreed sharding, name the shapes.
TEST(ProjectedExchangeErrors, ShapesAgainstThePlan) {
  const Group g = Group::solo();
  const auto heads = HeadPartition::make(4, 2, 1);
  const at::Tensor x = at::zeros({1, 4, 8});
  const std::vector<HeadProjection> p{{at::zeros({8, 8}), c10::nullopt, Heads::kKeyValue}};
  const Sharding sharding = agree_projection_plan(g, heads, x, p);
  EXPECT_THROW(
      {
        try {
          scatter_projected(at::zeros({1, 5, 8}), p, sharding, g);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(std::string(e.what()).find("x must hold this rank's 4 tokens in dim 1; got "
                                               "shape [1, 5, 8]"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::ValueError);
  EXPECT_THROW(
      {
        try {
          gather_projected(at::zeros({1, 4, 4, 4}), at::zeros({8, 12}), sharding, g);
        } catch (const c10::ValueError& e) {
          EXPECT_NE(
              std::string(e.what()).find("weight must be [E, 4 query heads x 4]; got [8, 12]"),
              std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::ValueError);
}

}  // namespace
}  // namespace ulysses
