#include "transport/wait.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>

namespace ulysses {
std::string seconds(std::chrono::milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", t.count() / 1e3);
  return text;
}

std::chrono::milliseconds log_wait_after(const Group& g) {
  using std::chrono::milliseconds;
  const double fraction = g.options().log_wait_fraction;
  if (fraction <= 0 || fraction >= 1) return g.timeout();
  return std::max(milliseconds(1),
                  milliseconds(static_cast<int64_t>(g.timeout().count() * fraction)));
}

std::string ranks_where(const Group& g, const std::function<bool(int)>& waiting) {
  std::ostringstream peers;
  const char* sep = "";
  for (int r = 0; r < g.size(); ++r) {
    if (r == g.rank() || !waiting(r)) continue;
    peers << sep << r;
    sep = ", ";
  }
  return peers.str();
}

void log_wait(const Group& g, std::chrono::milliseconds waited, const std::string& op,
              int64_t number, const std::string& peers) {
  LOG(WARNING) << "ulysses: rank " << g.rank() << " of " << g.size() << " has waited "
               << seconds(waited) << " s of its " << seconds(g.timeout()) << " s timeout in " << op
               << " #" << number << " of group '" << g.name() << "' for ranks " << peers;
}

void fail_wait(const Group& g, const std::string& op, int64_t number, const std::string& what) {
  TORCH_CHECK(false, "ulysses: collective ", op, " #", number, " failed on rank ", g.rank(), " of ",
              g.size(), " (timeout ", g.timeout().count(),
              " ms; a peer may have died or skipped it): ", what);
}

void wait(const Group& g, const char* op, const c10::intrusive_ptr<c10d::Work>& work,
          int64_t number, c10::DeviceType device, const std::vector<int64_t>* out_splits,
          const std::vector<int64_t>* in_splits) {
  const std::chrono::milliseconds timeout = g.timeout();
  const std::chrono::milliseconds first = log_wait_after(g);
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
    // Only an all-to-all's peers with a non-empty chunk either way are waited for.
    log_wait(g, first, op, number, ranks_where(g, [&](int r) {
               return !out_splits || (*out_splits)[r] != 0 || (*in_splits)[r] != 0;
             }));
    work->wait(timeout - first);
  } catch (const c10::Error& e) {
    fail_wait(g, op, number, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail_wait(g, op, number, e.what());
  }
}

}  // namespace ulysses
