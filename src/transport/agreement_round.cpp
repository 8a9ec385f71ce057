// Group::agree, the fail-fast round every check of the library runs through: each rank's local
// outcome and metadata in one collective of a fixed size, then the same error on every rank.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "plan/fnv1a.h"
#include "transport/transfers.h"
#include "ulysses/group.h"

namespace ulysses {

// Most metadata values one rank contributes to Group::agree.
constexpr int64_t kAgreeMetaLimit = 96;

namespace {
// Error kinds carried through `agree`, so every rank rethrows the original type.
enum ErrorKind : int64_t { kNoError = 0, kValue, kType, kNotImplemented, kIndex, kOther };

ErrorKind classify(const c10::Error& e) {
  if (dynamic_cast<const c10::ValueError*>(&e)) return kValue;
  if (dynamic_cast<const c10::TypeError*>(&e)) return kType;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return kNotImplemented;
  if (dynamic_cast<const c10::IndexError*>(&e)) return kIndex;
  return kOther;
}

[[noreturn]] void throw_kind(int64_t kind, const std::string& msg) {
  switch (kind) {
    case kValue:
      TORCH_CHECK_VALUE(false, msg);
    case kType:
      TORCH_CHECK_TYPE(false, msg);
    case kNotImplemented:
      TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
    case kIndex:
      TORCH_CHECK_INDEX(false, msg);
    default:
      TORCH_CHECK(false, msg);
  }
}
}  // namespace

namespace {
// Note [Metadata device]: the agreement rounds move a few int64s. They go as CPU tensors when
// the process group has a CPU backend (Gloo, or "cpu:gloo,cuda:nccl"), else on the current
// device of the group's accelerator (an NCCL-only group takes CUDA tensors alone).
at::Device metadata_device(c10d::ProcessGroup* pg) {
  if (pg == nullptr || has_backend(*pg, at::kCPU)) {
    return at::kCPU;
  }
  const std::vector<c10::Device> types = pg->getDeviceTypes();
  TORCH_CHECK_VALUE(!types.empty(), "Group: process group '", pg->getGroupName(),
                    "' has no backend for any device");
  return c10::impl::getDeviceGuardImpl(types.front().type())->getDevice();
}
}  // namespace

std::vector<std::vector<int64_t>> Group::agree(
    const std::function<std::vector<int64_t>()>& local_check, const std::string& purpose) const {
  int64_t kind = kNoError;
  std::string message;
  std::vector<int64_t> meta;
  try {
    meta = local_check();
    TORCH_CHECK_VALUE(meta.size() <= static_cast<size_t>(kAgreeMetaLimit), "agree: at most ",
                      kAgreeMetaLimit, " metadata values per rank; got ", meta.size(),
                      " (too many tensors in one call?)");
  } catch (const c10::Error& e) {
    kind = classify(e);
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    kind = kOther;
    message = e.what();
  }
  if (kind != kNoError) meta.clear();

  // Round 1, the same size on every rank whatever its inputs (Gloo aborts the process on
  // mismatched sizes): [kind, message length, purpose hash, purpose length, metadata count,
  // metadata padded to the limit].
  constexpr int64_t kHeader = 5;
  const int64_t row = kHeader + kAgreeMetaLimit;
  at::Tensor mine = at::zeros({row}, at::kLong);
  auto* p = mine.data_ptr<int64_t>();
  p[0] = kind;
  p[1] = static_cast<int64_t>(message.size());
  p[2] = Fnv1a().add(purpose).non_negative();
  p[3] = static_cast<int64_t>(purpose.size());
  p[4] = static_cast<int64_t>(meta.size());
  std::copy(meta.begin(), meta.end(), p + kHeader);
  const at::Device device = metadata_device(pg_.get());
  at::Tensor all = all_gather(mine.to(device)).cpu();
  auto acc = all.accessor<int64_t, 2>();
  int failing = -1;
  bool same_purpose = true;
  int64_t longest = 0, longest_purpose = 0;
  for (int r = 0; r < size(); ++r) {
    if (acc[r][0] != kNoError && failing < 0) failing = r;
    same_purpose = same_purpose && acc[r][2] == acc[0][2];
    longest = std::max(longest, acc[r][1]);
    longest_purpose = std::max(longest_purpose, acc[r][3]);
  }
  // Round 2 (failures and mixed purposes only; every rank knows the longest text): texts.
  auto gather_texts = [&](const std::string& text, int64_t longest_text) {
    at::Tensor t = at::zeros({std::max<int64_t>(1, longest_text)}, at::kByte);
    std::copy(text.begin(), text.end(), t.data_ptr<uint8_t>());
    return all_gather(t.to(device)).cpu();
  };
  auto text_of = [](const at::Tensor& texts, int r, int64_t length) {
    const auto* chars = reinterpret_cast<const char*>(texts[r].data_ptr<uint8_t>());
    return std::string(chars, chars + length);
  };
  if (failing >= 0) {
    // A failure wins over mixed purposes: fail_together's round meets any other round.
    const at::Tensor texts = gather_texts(message, longest);
    std::ostringstream msg;
    msg << text_of(texts, failing, acc[failing][1]) << " [raised on rank " << failing << " of "
        << size() << "]";
    throw_kind(acc[failing][0], msg.str());
  }
  if (!same_purpose) {
    const at::Tensor texts = gather_texts(purpose, longest_purpose);
    std::ostringstream msg;
    msg << "ranks are in different agreement rounds:";
    for (int r = 0; r < size(); ++r) {
      msg << (r ? "," : "") << " rank " << r << " in " << text_of(texts, r, acc[r][3]);
    }
    msg << ". An argument given on some ranks only (seq_lens, a mask, position_ids, a "
           "StepContext) sends ranks down different paths: give it on every rank or on none";
    TORCH_CHECK_VALUE(false, msg.str());
  }
  // Ranks of one purpose may hold different amounts (a call fingerprint is as long as its
  // tensors' dims): each caller compares what it gathered, naming the argument that differs.
  std::vector<std::vector<int64_t>> out(size());
  for (int r = 0; r < size(); ++r) out[r].assign(&acc[r][kHeader], &acc[r][kHeader] + acc[r][4]);
  return out;
}

void Group::fail_together(const std::exception_ptr& error) const {
  agree([&]() -> std::vector<int64_t> { std::rethrow_exception(error); });
  TORCH_INTERNAL_ASSERT(false, "Group::agree returned although this rank failed");
}

}  // namespace ulysses
