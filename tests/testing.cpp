#include "testing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pybind11/embed.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "transport/group_runtime.h"
#include "ulysses/mesh.h"

namespace py = pybind11;

namespace ulysses::testing {
namespace {

// The embedded interpreter that creates the ranks' process groups through torch.distributed
// (tests/thread_groups.py). Started on first use; the GIL is released between uses.
class Python {
 public:
  static Python& get() {
    static Python python;
    return python;
  }
  // Runs `fn` holding the GIL.
  template <typename Fn>
  auto with_gil(Fn&& fn) {
    py::gil_scoped_acquire gil;
    return fn(helpers_);
  }

 private:
  Python() {
    py::initialize_interpreter();
    {
      py::module_ sys = py::module_::import("sys");
      sys.attr("path").attr("insert")(0, ULYSSES_SITE_PACKAGES);
      sys.attr("path").attr("insert")(0, ULYSSES_TESTS_DIR);
      helpers_ = py::module_::import("thread_groups");
    }
    saved_ = PyEval_SaveThread();
  }
  py::module_ helpers_;             // tests/thread_groups.py.
  PyThreadState* saved_ = nullptr;  // The main thread state while the GIL is released.
};

}  // namespace

void set_up_links(const Group& g) { g.runtime().links(g); }

std::vector<std::string> run_ranks(int world, const std::function<void(Group&)>& body,
                                   std::chrono::milliseconds timeout) {
  // The ranks share the machine's cores: one intra-op thread each.
  at::set_num_threads(1);
  // Real Gloo groups from torch.distributed, one per rank thread, found by name in C++.
  std::vector<Group> groups;
  Python::get().with_gil([&](py::module_& helpers) {
    py::tuple made = helpers.attr("make_thread_groups")(world, timeout.count() / 1000.0);
    GroupOptions options;
    options.timeout = timeout;
    for (const auto& name : made[0].cast<std::vector<std::string>>())
      groups.push_back(Group::resolve(name, options));
    helpers.attr("release")(made[0]);
    return 0;
  });
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        Group g = groups[r];
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

Mesh::Split thread_split(const Group& world) {
  const std::string name = world.name();
  const std::string run = name.substr(0, name.rfind('/'));
  const int rank = world.rank();
  const auto timeout = world.timeout();
  return [run, rank, timeout](const std::vector<std::vector<int>>& partition) {
    static std::mutex mu;
    static std::map<std::pair<std::string, std::vector<std::vector<int>>>, std::vector<Group>>
        made;  // Guarded by mu: for each run and partition, every rank's group.
    std::lock_guard<std::mutex> lock(mu);
    auto& groups = made[{run, partition}];
    if (groups.empty()) {
      int world_size = 0;
      for (const auto& part : partition) world_size += static_cast<int>(part.size());
      groups.resize(world_size, Group::solo());
      Python::get().with_gil([&](py::module_& helpers) {
        for (const auto& part : partition) {
          py::tuple t = helpers.attr("make_thread_groups")(part.size(), timeout.count() / 1000.0);
          auto names = t[0].cast<std::vector<std::string>>();
          for (size_t i = 0; i < part.size(); ++i) groups[part[i]] = Group::resolve(names[i]);
          helpers.attr("release")(t[0]);
        }
        return 0;
      });
    }
    return groups.at(rank);
  };
}

AbsentPeerRun run_with_absent_peer(const std::function<Group(Group&)>& setup,
                                   const std::function<void(const Group&)>& body) {
  ::testing::internal::CaptureStderr();
  auto errors = run_ranks(
      2,
      [&](Group& world) {
        const Group g = setup(world);
        if (g.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(5));  // Never joins `body`.
          return;
        }
        body(g);
      },
      std::chrono::milliseconds(2500));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(errors[1], "");
  return {errors[0], log};
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
    case Layout::kBSHD:
      return {B, S, H, D};
    case Layout::kSBHD:
      return {S, B, H, D};
    case Layout::kBHSD:
      return {B, H, S, D};
  }
  return {};
}

std::string where(const Group& g, const at::Tensor& t) {
  std::ostringstream os;
  os << "rank " << g.rank() << " of " << g.size() << ", dtype " << t.scalar_type() << ", shape "
     << t.sizes();
  return os.str();
}

std::shared_ptr<bool> freed_when_its_node_ran(const at::Tensor& out) {
  auto freed = std::make_shared<bool>(false);
  out.grad_fn()->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [freed, bytes = out.storage().getWeakStorageImpl()](
          const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        *freed = bytes.expired();
        return outputs;
      }));
  return freed;
}

}  // namespace ulysses::testing
