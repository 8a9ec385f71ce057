#include "testing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <sstream>
#include <thread>

namespace ulysses::testing {

std::vector<std::string> run_ranks(int world, const std::function<void(Group&)>& body,
                                   std::chrono::milliseconds timeout) {
  // The ranks share the machine's cores: one intra-op thread each.
  at::set_num_threads(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        GroupOptions options;
        options.timeout = timeout;
        Group g = Group::create(store, r, world, options);
        body(g);
      } catch (const c10::Error& e) {
        errors[r] = e.what_without_backtrace();
        if (errors[r].empty()) errors[r] = "(empty c10::Error)";
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty std::exception)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void expect_ranks_succeed(int world, const std::function<void(Group&)>& body) {
  auto errors = run_ranks(world, body);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r << " of " << world << " failed";
  }
}

void expect_ranks_fail_alike(const std::vector<std::string>& errors, const std::string& needle) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find(needle), std::string::npos)
        << "rank " << r << " error '" << errors[r] << "' lacks '" << needle << "'";
    EXPECT_EQ(errors[r], errors[0]) << "rank " << r << " raised a different error than rank 0";
  }
}

double rel_error(const at::Tensor& a, const at::Tensor& b, double floor) {
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  EXPECT_EQ(x.sizes(), y.sizes());
  if (x.numel() == 0) return 0.0;
  return (x - y).abs().max().item<double>() / std::max(y.abs().max().item<double>(), floor);
}

at::Tensor seeded_randn(at::IntArrayRef shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

std::vector<int64_t> full_shape(Layout layout, int64_t B, int64_t S, int64_t H, int64_t D) {
  switch (layout) {
    case Layout::kBSHD: return {B, S, H, D};
    case Layout::kSBHD: return {S, B, H, D};
    case Layout::kBHSD: return {B, H, S, D};
  }
  return {};
}

std::string where(const Group& g, const at::Tensor& t) {
  std::ostringstream os;
  os << "rank " << g.rank() << " of " << g.size() << ", dtype " << t.scalar_type() << ", shape "
     << t.sizes();
  return os.str();
}

}  // namespace ulysses::testing
