#include "plan/call_fingerprint.h"

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <functional>
#include <sstream>

#include "ulysses/partition.h"

namespace ulysses {
namespace {

// Wire form: plan ints, then each TensorFacts as [given, dims, sizes..., dtype, device type,
// on first device, requires grad], then the options.
void put(std::vector<int64_t>& out, const TensorFacts& t) {
  out.push_back(t.given);
  out.push_back(static_cast<int64_t>(t.sizes.size()));
  out.insert(out.end(), t.sizes.begin(), t.sizes.end());
  out.push_back(t.dtype);
  out.push_back(t.device_type);
  out.push_back(t.on_first_device);
  out.push_back(t.requires_grad);
}

class Reader {
 public:
  explicit Reader(const std::vector<int64_t>& v) : v_(v) {}
  int64_t next() {
    TORCH_CHECK(i_ < v_.size(), "CallFingerprint::decode: too few values (", v_.size(), ")");
    return v_[i_++];
  }
  TensorFacts facts() {
    TensorFacts t;
    t.given = next() != 0;
    const int64_t dims = next();
    TORCH_CHECK(dims >= 0 && dims <= 8, "CallFingerprint::decode: bad dim count ", dims);
    for (int64_t d = 0; d < dims; ++d) t.sizes.push_back(next());
    t.dtype = next();
    t.device_type = next();
    t.on_first_device = next() != 0;
    t.requires_grad = next() != 0;
    return t;
  }
  bool done() const { return i_ == v_.size(); }

 private:
  const std::vector<int64_t>& v_;
  size_t i_ = 0;
};

int64_t bits_of(double d) {
  int64_t i = 0;
  std::memcpy(&i, &d, sizeof(d));
  return i;
}

double double_of(int64_t i) {
  double d = 0;
  std::memcpy(&d, &i, sizeof(d));
  return d;
}

// One compared field: its name, its value, and how a value reads in a message.
struct Field {
  std::string name;
  int64_t value;
  std::function<std::string(int64_t)> text;
  bool is_dtype = false;
};

std::string as_int(int64_t v) { return std::to_string(v); }
std::string as_bool(int64_t v) { return v ? "yes" : "no"; }
std::string as_dtype(int64_t v) {
  return v < 0 ? "none" : c10::toString(static_cast<c10::ScalarType>(v));
}
std::string as_device(int64_t v) {
  return v < 0 ? "none" : c10::DeviceTypeName(static_cast<c10::DeviceType>(v), true);
}
std::string as_layout(int64_t v) { return to_string(static_cast<Layout>(v)); }
std::string as_window(int64_t v) { return v == 0 ? "none" : std::to_string(v); }
// A double's bits as its value, or `zero` for 0 (the option's default).
std::string as_real(int64_t v, const char* zero) {
  const double d = double_of(v);
  if (d == 0) return zero;
  std::ostringstream os;
  os << d;
  return os.str();
}
std::string as_softcap(int64_t v) { return as_real(v, "none"); }
std::string as_split(int64_t v) { return v < 0 ? "none (learned)" : "given"; }
std::string as_scale(int64_t v) { return as_real(v, "default (1/sqrt(D))"); }

// The fields every rank must hold alike, in the order they are compared: counts and dims come
// before the sizes they govern, so two lists differ first where their structure does.
// `free_dim`: a tensor dim that may differ (the sequence dim), -1 none.
void facts_fields(std::vector<Field>& f, const std::string& name, const TensorFacts& t,
                  int64_t free_dim, bool compare_sizes) {
  f.push_back({"whether " + name + " is given", t.given, as_bool});
  if (!t.given) return;
  f.push_back({name + "'s number of dims", static_cast<int64_t>(t.sizes.size()), as_int});
  if (compare_sizes) {
    for (size_t d = 0; d < t.sizes.size(); ++d) {
      if (static_cast<int64_t>(d) == free_dim) continue;
      f.push_back({name + "'s dim " + std::to_string(d), t.sizes[d], as_int});
    }
  }
  f.push_back({name + "'s dtype", t.dtype, as_dtype, true});
  f.push_back({name + "'s device type", t.device_type, as_device});
  f.push_back({"whether " + name + " is on the first tensor's device", t.on_first_device, as_bool});
}

std::vector<Field> fields(const CallFingerprint& c, const std::vector<std::string>& names) {
  std::vector<Field> f;
  f.push_back({"the number of exchanged tensors", static_cast<int64_t>(c.tensors.size()), as_int});
  f.push_back({"q_heads", c.q_heads, as_int});
  f.push_back({"kv_heads", c.kv_heads, as_int});
  f.push_back({"the SP group size", c.sp_size, as_int});
  f.push_back({"the layout", c.layout, as_layout});
  f.push_back({"the given sequence split (seq_lens)", c.seq_split, as_split});
  const int64_t sdim = seq_dim(static_cast<Layout>(c.layout));
  bool grad = false;
  std::string all;
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    const std::string name = t < names.size() ? names[t] : "tensor " + std::to_string(t);
    facts_fields(f, name, c.tensors[t], sdim, true);
    grad = grad || c.tensors[t].requires_grad;
    all += (t ? ", " : "") + name;
  }
  f.push_back({"whether " + all + " require grad", grad, as_bool});
  facts_fields(f, "the mask", c.mask, -1, false);
  if (c.mask.given) f.push_back({"whether the mask requires grad", c.mask.requires_grad, as_bool});
  // Position ids are [B, S_r] by then (a [S_r] form is expanded first): dim 1 may differ.
  facts_fields(f, "position_ids", c.positions, 1, true);
  if (c.positions.given) {
    f.push_back({"whether position_ids require grad", c.positions.requires_grad, as_bool});
  }
  f.push_back({"causal", c.causal, as_bool});
  f.push_back({"scale", bits_of(c.scale), as_scale});
  f.push_back({"window", c.window, as_window});
  f.push_back({"softcap", bits_of(c.softcap), as_softcap});
  facts_fields(f, "sinks", c.sinks, -1, true);
  if (c.sinks.given) f.push_back({"whether sinks require grad", c.sinks.requires_grad, as_bool});
  f.push_back({"whether a StepContext is used", c.step_context, as_bool});
  f.push_back(
      {"whether later calls of the step may reuse this call's agreement (whole q, k, v "
       "moved fused, no ring)",
       c.reuses_agreement, as_bool});
  f.push_back({"the S x S buffer of the local attention off the CPU", c.square_off_cpu, as_int});
  f.push_back({"GroupOptions::pipeline_min_bytes", c.pipeline_min_bytes, as_int});
  f.push_back({"GroupOptions::message_bytes", c.message_bytes, as_int});
  f.push_back({"GroupOptions::shared_memory", c.shared_memory, as_bool});
  f.push_back({"whether transfers are batched (GroupOptions::transport)", c.batched, as_bool});
  return f;
}

}  // namespace

std::vector<int64_t> CallFingerprint::encode() const {
  std::vector<int64_t> out{q_heads,       kv_heads,
                           sp_size,       layout,
                           seq_split,     pipeline_min_bytes,
                           message_bytes, shared_memory,
                           batched,       static_cast<int64_t>(tensors.size())};
  for (const TensorFacts& t : tensors) put(out, t);
  put(out, mask);
  put(out, positions);
  out.push_back(causal);
  out.push_back(bits_of(scale));
  out.push_back(window);
  out.push_back(bits_of(softcap));
  put(out, sinks);
  out.push_back(step_context);
  out.push_back(reuses_agreement);
  out.push_back(square_off_cpu);
  return out;
}

CallFingerprint CallFingerprint::decode(const std::vector<int64_t>& values) {
  Reader r(values);
  CallFingerprint c;
  c.q_heads = r.next();
  c.kv_heads = r.next();
  c.sp_size = r.next();
  c.layout = r.next();
  c.seq_split = r.next();
  c.pipeline_min_bytes = r.next();
  c.message_bytes = r.next();
  c.shared_memory = r.next();
  c.batched = r.next();
  const int64_t n = r.next();
  TORCH_CHECK(n >= 0 && n <= 64, "CallFingerprint::decode: bad tensor count ", n);
  for (int64_t t = 0; t < n; ++t) c.tensors.push_back(r.facts());
  c.mask = r.facts();
  c.positions = r.facts();
  c.causal = r.next() != 0;
  c.scale = double_of(r.next());
  c.window = r.next();
  c.softcap = double_of(r.next());
  c.sinks = r.facts();
  c.step_context = r.next() != 0;
  c.reuses_agreement = r.next() != 0;
  c.square_off_cpu = r.next();
  TORCH_CHECK(r.done(), "CallFingerprint::decode: ", values.size(), " values, more than encoded");
  return c;
}

void check_alike(const std::vector<CallFingerprint>& all, const std::vector<std::string>& names,
                 const std::string& who) {
  TORCH_INTERNAL_ASSERT(!all.empty());
  std::vector<std::vector<Field>> f;
  for (const CallFingerprint& c : all) f.push_back(fields(c, names));
  for (size_t i = 0; i < f[0].size(); ++i) {
    bool alike = true;
    for (size_t r = 1; r < f.size(); ++r)
      alike = alike && i < f[r].size() && f[r][i].value == f[0][i].value;
    if (alike) continue;
    std::ostringstream os;
    os << who << "ranks disagree on " << f[0][i].name << ":";
    for (size_t r = 0; r < f.size(); ++r) {
      os << (r ? "," : "") << " rank " << r << " has ";
      os << (i < f[r].size() && f[r][i].name == f[0][i].name ? f[r][i].text(f[r][i].value)
                                                             : "(other fields)");
    }
    if (f[0][i].is_dtype) TORCH_CHECK_TYPE(false, os.str());
    TORCH_CHECK_VALUE(false, os.str());
  }
}

}  // namespace ulysses
