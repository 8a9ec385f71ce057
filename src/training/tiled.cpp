#include "ulysses/tiled.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dispatch/autograd.h"
#include "training/offloaded_bytes.h"
#include "ulysses/partition.h"

namespace ulysses {

namespace {

std::atomic<int64_t> live_offload_bytes{0};

constexpr const char* kCheckpointNames[] = {"none", "recompute", "offload"};

bool needs_backward(const std::vector<at::Tensor>& inputs) {
  return at::GradMode::is_enabled() && torch::autograd::compute_requires_grad(inputs);
}

// The even split of [0, rows) into `tiles`, the empty ranges (tiles > rows) left out.
std::vector<Range> tile_ranges(int64_t rows, int64_t tiles) {
  std::vector<Range> ranges;
  for (const Range& r : even_split(rows, tiles))
    if (r.size() > 0) ranges.push_back(r);
  return ranges;
}

std::vector<at::Tensor> with_params(const at::Tensor& x, const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> inputs{x};
  inputs.insert(inputs.end(), params.begin(), params.end());
  return inputs;
}

// Runs f on x (detached; a leaf needing a gradient if x_grad) with grad mode on and returns the
// gradients of x and `params`
// for the output gradient `grad`: the recompute shared by tiled_map and checkpoint.
std::vector<at::Tensor> recompute_gradients(const TensorFunction& f, const at::Tensor& x,
                                            bool x_grad, const std::vector<at::Tensor>& params,
                                            const at::Tensor& grad) {
  at::AutoGradMode grad_mode(true);
  at::Tensor input = x.detach().requires_grad_(x_grad);
  at::Tensor out = f(input);
  std::vector<at::Tensor> wrt;  // Only inputs that take a gradient: autograd::grad needs them.
  std::vector<size_t> slot;
  const std::vector<at::Tensor> inputs = with_params(input, params);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].requires_grad()) wrt.push_back(inputs[i]), slot.push_back(i);
  }
  std::vector<at::Tensor> grads(inputs.size());
  if (wrt.empty() || !out.requires_grad()) return grads;
  auto found = torch::autograd::grad({out}, wrt, {grad}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t j = 0; j < slot.size(); ++j) grads[slot[j]] = found[j];
  return grads;
}

// The generators' states, saved at forward and replayed for the recompute (dropout-like ops
// draw the same numbers): the CPU generator's, and the device's default generator's when the
// input lives on a device (CUDA dropout draws from it). Their own states are put back after.
class GeneratorReplay {
 public:
  explicit GeneratorReplay(const c10::Device& device) {
    generators_.push_back(at::detail::getDefaultCPUGenerator());
    if (!device.is_cpu() && !device.is_meta())
      generators_.push_back(at::globalContext().defaultGenerator(device));
    for (at::Generator& gen : generators_) states_.push_back(state_of(gen));
  }
  template <typename Fn>
  auto replay(Fn&& fn) const {
    struct Restore {
      std::vector<at::Generator> gens;
      std::vector<at::Tensor> states;
      ~Restore() {
        for (size_t i = 0; i < gens.size(); ++i) set(gens[i], states[i]);
      }
    } restore{generators_, {}};
    for (size_t i = 0; i < generators_.size(); ++i) {
      at::Generator gen = generators_[i];
      restore.states.push_back(state_of(gen));
      set(gen, states_[i]);
    }
    return fn();
  }

 private:
  static at::Tensor state_of(at::Generator& gen) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }
  static void set(at::Generator gen, const at::Tensor& state) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  std::vector<at::Generator> generators_;
  std::vector<at::Tensor> states_;
};

// x's host copy for an offloaded checkpoint, made in the background. On CPU a worker thread
// copies (the forward goes on meanwhile). On a device, a non-blocking copy into pinned memory
// on a side stream that waits for x's producer (an event on the current stream); x is
// recorded on the side stream so its memory is not reused before the copy ends, and restore
// makes the current stream wait for the copy. Counted in live_offload_bytes while it lives.
class HostCopy {
 public:
  explicit HostCopy(const at::Tensor& x) : device_(x.device()), bytes_(x.nbytes()) {
    count_offloaded_bytes(bytes_);
    if (x.is_cpu()) {
      pending_ = std::async(std::launch::async, [x] { return x.clone(); });
      return;
    }
    const c10::impl::VirtualGuardImpl impl(device_.type());
    const c10::Stream compute = impl.getStream(device_);
    const c10::Stream side = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
    c10::Event produced(device_.type());
    produced.record(compute);
    produced.block(side);
    host_ = at::empty(x.sizes(), x.options().device(at::kCPU).pinned_memory(true));
    {
      const c10::StreamGuard on_side(side);
      host_.copy_(x, /*non_blocking=*/true);
    }
    x.record_stream(side);
    copied_.emplace(device_.type());
    copied_->record(side);
  }
  // A pending copy is waited for here (std::async's future), so the worker never outlives it.
  ~HostCopy() { count_offloaded_bytes(-bytes_); }
  HostCopy(const HostCopy&) = delete;
  HostCopy& operator=(const HostCopy&) = delete;

  // The input back on its device (waits for the copy). Called by backward, once per run.
  at::Tensor restore() {
    if (pending_.valid()) host_ = pending_.get();
    if (device_.is_cpu()) return host_;
    copied_->block(c10::impl::VirtualGuardImpl(device_.type()).getStream(device_));
    return host_.to(device_, /*non_blocking=*/true);
  }

 private:
  c10::Device device_;
  int64_t bytes_;
  std::future<at::Tensor> pending_;  // The CPU worker's copy, until restore takes it.
  at::Tensor host_;
  std::optional<c10::Event> copied_;  // Device inputs: the side stream's copy is done.
};

}  // namespace

std::string target_problem(const at::Tensor& targets, int64_t vocab, int64_t ignore_index,
                           const std::string& who, const std::string& name) {
  std::ostringstream problem;
  if (targets.scalar_type() != at::kLong) {
    problem << who << ": " << name << " must be int64; got " << targets.scalar_type();
    return problem.str();
  }
  const at::Tensor scored = targets.masked_select(targets.ne(ignore_index));
  if (scored.numel() > 0 &&
      (scored.min().item<int64_t>() < 0 || scored.max().item<int64_t>() >= vocab)) {
    problem << who << ": " << name << " must be in [0, " << vocab << ") or ignore_index ("
            << ignore_index << ")";
  }
  return problem.str();
}

void check_targets(const at::Tensor& targets, int64_t vocab, int64_t ignore_index,
                   const char* who) {
  const std::string problem = target_problem(targets, vocab, ignore_index, who, "targets");
  TORCH_CHECK_TYPE(targets.scalar_type() == at::kLong, problem);
  TORCH_CHECK_VALUE(problem.empty(), problem);
}

int64_t tile_count(int64_t rows, int64_t tile_rows) {
  TORCH_CHECK_VALUE(rows >= 0 && tile_rows >= 1,
                    "tile_count: tile_rows must be >= 1 and rows >= 0; got rows ", rows,
                    ", tile_rows ", tile_rows);
  return std::max<int64_t>(1, (rows + tile_rows - 1) / tile_rows);
}

at::Tensor tiled_map(const TensorFunction& f, const at::Tensor& x, int64_t tiles,
                     const std::vector<at::Tensor>& params, int64_t dim) {
  TORCH_CHECK_VALUE(tiles >= 1, "tiled_map: tiles must be >= 1; got ", tiles);
  dim = c10::maybe_wrap_dim(dim, x.dim());
  const int64_t rows = x.size(dim);
  const std::vector<Range> ranges = tile_ranges(rows, tiles);
  const std::vector<at::Tensor> inputs = with_params(x, params);
  const bool backward = needs_backward(inputs);
  std::vector<at::Tensor> outs;
  {
    at::NoGradGuard no_grad;  // Backward recomputes each tile; forward keeps nothing of f.
    for (const Range& t : ranges) outs.push_back(f(x.narrow(dim, t.begin, t.size())));
  }
  std::vector<at::Tensor> result{outs.empty() ? f(x) : at::cat(outs, dim)};
  outs.clear();
  TORCH_CHECK_VALUE(result[0].dim() == x.dim() && result[0].size(dim) == rows, "tiled_map: f must ",
                    "keep the size of dim ", dim, "; got ", result[0].sizes(), " from ", x.sizes());
  if (!backward) return result[0];
  detail::attach_backward(inputs, result, "TiledMapBackward",
                          [f, x = x.detach(), x_grad = x.requires_grad(), params, dim,
                           ranges](std::vector<at::Tensor>&& grads) {
                            std::vector<at::Tensor> out(params.size() + 1);
                            if (x_grad) out[0] = at::empty_like(x);
                            for (const Range& t : ranges) {
                              std::vector<at::Tensor> g = recompute_gradients(
                                  f, x.narrow(dim, t.begin, t.size()), x_grad, params,
                                  grads[0].narrow(dim, t.begin, t.size()));
                              if (out[0].defined()) {
                                if (g[0].defined()) {
                                  out[0].narrow(dim, t.begin, t.size()).copy_(g[0]);
                                } else {
                                  out[0].narrow(dim, t.begin, t.size()).zero_();
                                }
                              }
                              for (size_t i = 1; i < g.size(); ++i) {
                                if (!g[i].defined()) continue;
                                if (out[i].defined()) {
                                  out[i].add_(g[i]);
                                } else {
                                  out[i] = std::move(g[i]);
                                }
                              }
                            }
                            return out;
                          });
  return result[0];
}

at::Tensor linear_cross_entropy_sum(const at::Tensor& hidden, const at::Tensor& weight,
                                    const at::Tensor& targets, int64_t tiles, int64_t ignore_index,
                                    const c10::optional<at::Tensor>& bias, double scale,
                                    double softcap) {
  TORCH_CHECK_VALUE(hidden.dim() == 2 && weight.dim() == 2 && targets.dim() == 1 &&
                        hidden.size(0) == targets.size(0) && hidden.size(1) == weight.size(1) &&
                        (!bias || bias->sizes() == at::IntArrayRef{weight.size(0)}),
                    "linear_cross_entropy_sum: hidden [N, E], weight [V, E], bias [V] or none and "
                    "targets [N] expected; got ",
                    hidden.sizes(), ", ", weight.sizes(), ", ",
                    bias ? bias->sizes() : at::IntArrayRef{}, " and ", targets.sizes());
  TORCH_CHECK_VALUE(tiles >= 1, "linear_cross_entropy_sum: tiles must be >= 1; got ", tiles);
  TORCH_CHECK_VALUE(softcap >= 0, "linear_cross_entropy_sum: softcap must be >= 0; got ", softcap);
  const int64_t N = hidden.size(0), V = weight.size(0);
  check_targets(targets, V, ignore_index, "linear_cross_entropy_sum");
  const std::vector<Range> ranges = tile_ranges(N, tiles);
  const at::Tensor valid = targets.ne(ignore_index);
  const at::Tensor picked = targets.masked_fill(valid.logical_not(), 0);
  // One tile's fp32 logits as the loss sees them, and with a softcap tanh(z / c) (its slope).
  auto logits = [=](const at::Tensor& h) -> std::pair<at::Tensor, at::Tensor> {
    at::Tensor z = at::linear(h, weight, bias).to(at::kFloat);
    if (scale != 1.0) z.mul_(scale);
    if (softcap == 0) return {z, at::Tensor()};
    at::Tensor capped = z.div_(softcap).tanh_();
    return {capped * softcap, capped};
  };
  at::Tensor lse = at::empty({N}, hidden.options().dtype(at::kFloat));
  std::vector<at::Tensor> result{at::zeros({}, hidden.options().dtype(at::kFloat))};
  {
    at::NoGradGuard no_grad;
    for (const Range& t : ranges) {
      const int64_t s = t.begin, n = t.size();
      const at::Tensor z = logits(hidden.narrow(0, s, n)).first;
      const at::Tensor l = at::logsumexp(z, -1);
      lse.narrow(0, s, n).copy_(l);
      const at::Tensor zy = z.gather(1, picked.narrow(0, s, n).unsqueeze(1)).squeeze(1);
      result[0] += (l - zy).masked_fill(valid.narrow(0, s, n).logical_not(), 0).sum();
    }
  }
  std::vector<at::Tensor> inputs{hidden, weight};
  if (bias) inputs.push_back(*bias);
  detail::attach_backward(
      inputs, result, "LinearCrossEntropyBackward", [=](std::vector<at::Tensor>&& grads) {
        at::NoGradGuard no_grad;
        const at::Tensor g = grads[0].to(at::kFloat);
        at::Tensor grad_h = hidden.requires_grad() ? at::empty_like(hidden) : at::Tensor();
        const auto fp32 = weight.options().dtype(at::kFloat);
        at::Tensor grad_w = weight.requires_grad() ? at::zeros(weight.sizes(), fp32) : at::Tensor();
        at::Tensor grad_b =
            bias && bias->requires_grad() ? at::zeros(bias->sizes(), fp32) : at::Tensor();
        for (const Range& t : ranges) {
          const int64_t s = t.begin, n = t.size();
          const at::Tensor h = hidden.narrow(0, s, n);
          auto [z, capped] = logits(h);
          // d/dz of the tile's sum: softmax(z) - onehot(y) on valid rows, times the loss grad,
          // then through the softcap's tanh and the scale.
          at::Tensor dz = z.sub_(lse.narrow(0, s, n).unsqueeze(1)).exp_();
          const at::Tensor y = picked.narrow(0, s, n).unsqueeze(1);
          dz.scatter_add_(1, y, at::full({n, 1}, -1.0, dz.options()));
          dz.mul_(valid.narrow(0, s, n).unsqueeze(1).to(at::kFloat) * g);
          if (capped.defined()) dz.mul_(1 - capped.square_());
          if (scale != 1.0) dz.mul_(scale);
          if (grad_h.defined())
            grad_h.narrow(0, s, n).copy_(at::matmul(dz.to(weight.scalar_type()), weight));
          if (grad_w.defined()) grad_w.addmm_(dz.t(), h.to(at::kFloat));
          if (grad_b.defined()) grad_b.add_(dz.sum(0));
        }
        std::vector<at::Tensor> out{grad_h,
                                    grad_w.defined() ? grad_w.to(weight.scalar_type()) : grad_w};
        if (bias) out.push_back(grad_b.defined() ? grad_b.to(bias->scalar_type()) : grad_b);
        return out;
      });
  return result[0];
}

at::Tensor checkpoint(const TensorFunction& f, const at::Tensor& x,
                      const std::vector<at::Tensor>& params, Checkpoint mode) {
  const std::vector<at::Tensor> inputs = with_params(x, params);
  if (mode == Checkpoint::kNone || !needs_backward(inputs)) return f(x);
  const GeneratorReplay rng(x.device());
  std::shared_ptr<HostCopy> host;
  if (mode == Checkpoint::kOffload) host = std::make_shared<HostCopy>(x);
  std::vector<at::Tensor> result;
  {
    at::NoGradGuard no_grad;
    result.push_back(f(x));
  }
  // The node keeps either x or its host copy: the caller's x is not held past forward.
  at::Tensor kept = host ? at::Tensor() : x.detach();
  const bool x_grad = x.requires_grad();
  detail::attach_backward(
      inputs, result, "CheckpointBackward",
      [f, params, host, kept, x_grad, rng](std::vector<at::Tensor>&& grads) {
        const at::Tensor input = host ? host->restore() : kept;
        return rng.replay([&] { return recompute_gradients(f, input, x_grad, params, grads[0]); });
      });
  return result[0];
}

int64_t offloaded_bytes() { return live_offload_bytes.load(); }
void count_offloaded_bytes(int64_t delta) { live_offload_bytes += delta; }

std::string to_string(Checkpoint mode) { return kCheckpointNames[static_cast<int>(mode)]; }

Checkpoint parse_checkpoint(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == kCheckpointNames[i]) return static_cast<Checkpoint>(i);
  TORCH_CHECK_VALUE(false, "checkpoint must be none, recompute or offload; got '", name, "'");
}

int64_t loss_tile_count(int64_t rows, int64_t vocab, int64_t tile_bytes) {
  TORCH_CHECK_VALUE(vocab >= 1 && tile_bytes >= 1,
                    "loss_tile_count: vocab and tile_bytes must be >= 1; got ", vocab, " and ",
                    tile_bytes);
  return tile_count(rows, std::max<int64_t>(1, tile_bytes / (4 * vocab)));
}

}  // namespace ulysses
