#include "transport/wait.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>

namespace ulysses {
namespace {

// Peers whose contribution a collective of this rank waits for: every other rank, or for an
// all-to-all only those it exchanges a non-empty chunk with.
std::string peer_list(const Group& g, const std::vector<int64_t>* out_splits,
                      const std::vector<int64_t>* in_splits) {
  std::ostringstream peers;
  const char* sep = "";
  for (int r = 0; r < g.size(); ++r) {
    if (r == g.rank()) continue;
    if (out_splits && (*out_splits)[r] == 0 && (*in_splits)[r] == 0) continue;
    peers << sep << r;
    sep = ", ";
  }
  return peers.str();
}

}  // namespace

std::string seconds(std::chrono::milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", t.count() / 1e3);
  return text;
}

void wait(const Group& g, const char* op, const c10::intrusive_ptr<c10d::Work>& work,
          int64_t number, c10::DeviceType device, const std::vector<int64_t>* out_splits,
          const std::vector<int64_t>* in_splits) {
  using std::chrono::milliseconds;
  const milliseconds timeout = g.options().timeout;
  auto fail = [&](const std::string& what) {
    TORCH_CHECK(false, "ulysses: collective ", op, " #", number, " failed on rank ", g.rank(),
                " of ", g.size(), " (timeout ", timeout.count(),
                " ms; a peer may have died or skipped it): ", what);
  };
  const double fraction = g.options().log_wait_fraction;
  milliseconds first = timeout;
  if (fraction > 0 && fraction < 1) {
    first =
        std::max(milliseconds(1), milliseconds(static_cast<int64_t>(timeout.count() * fraction)));
  }
  try {
    if (!waits_on_host(device)) {
      work->wait();
      return;
    }
    try {
      work->wait(first);
      return;
    } catch (const std::exception&) {
      // Work::wait throws when its wait ends before the work completes: then only slow.
      if (work->isCompleted() || first == timeout) throw;
    }
    // c10 logging, not TORCH_WARN: under Python a TORCH_WARN is held until the op returns, and
    // this line matters while the op is stuck. TORCH_CPP_LOG_LEVEL=ERROR silences it.
    LOG(WARNING) << "ulysses: rank " << g.rank() << " of " << g.size() << " has waited "
                 << seconds(first) << " s of its " << seconds(timeout) << " s timeout in " << op
                 << " #" << number << " of group '" << g.name() << "' for ranks "
                 << peer_list(g, out_splits, in_splits);
    work->wait(timeout - first);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

}  // namespace ulysses
