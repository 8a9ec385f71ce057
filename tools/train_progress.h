// `ulysses train`'s progress: a line every --log-every steps, and the activation memory at the end.
#pragma once

#include <chrono>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "proc_status.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/group.h"
#include "ulysses/mesh.h"

namespace ulysses::cli {

// `bytes` as whole megabytes (MiB), for the progress lines.
std::string mb(int64_t bytes);

// The progress lines: loss, tokens/s, share of time in collectives (and of it, the wait for the
// last rank to arrive) and every rank's peak RSS, averaged over the steps since the previous line.
class ProgressLog {
 public:
  ProgressLog(const Mesh& mesh, int64_t tokens_per_step)
      : mesh_(mesh), tokens_per_step_(tokens_per_step) {
    // Every distinct group that carries training traffic (a mesh's SP group may be the world).
    groups_.push_back(mesh.world);
    for (const Group& g : {mesh.sp, mesh.dp})
      if (g != mesh.world && g.size() > 1) groups_.push_back(g);
    restart();
  }

  void step_done() { ++steps_; }

  // Every rank calls it (the peak RSS is gathered); rank 0 prints.
  void print(int64_t step, int64_t steps, double loss) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const double comm = comm_seconds() - comm0_;
    std::optional<double> waiting = 0.0;  // Note [Waiting for the last rank].
    for (const Group& g : groups_) {
      const std::optional<double> w = g.recorder().take_waiting_seconds(g);
      waiting = waiting && w ? std::optional<double>(*waiting + *w) : std::nullopt;
    }
    at::Tensor rss = mesh_.world.all_gather(at::tensor({proc_status_bytes("VmHWM")}, at::kLong));
    if (mesh_.world.rank() == 0) {
      std::ostringstream line;
      line << "step " << step << "/" << steps << " loss " << std::fixed << std::setprecision(4)
           << loss << " tok/s " << std::setprecision(0) << tokens_per_step_ * steps_ / seconds
           << " comm " << std::setprecision(1) << 100.0 * comm / seconds << "%";
      if (waiting) line << " (waiting " << 100.0 * *waiting / seconds << "%)";
      line << " peak_rss_mb";
      for (int r = 0; r < mesh_.world.size(); ++r)
        line << (r ? "/" : " ") << mb(rss[r].item<int64_t>());
      std::cout << line.str() << std::endl;
    }
    restart();
  }

 private:
  double comm_seconds() const {
    double s = 0;
    for (const Group& g : groups_) s += g.recorder().seconds();
    return s;
  }
  void restart() {
    for (const Group& g : groups_) g.recorder().keep_times();
    start_ = std::chrono::steady_clock::now();
    comm0_ = comm_seconds();
    steps_ = 0;
  }
  const Mesh& mesh_;
  const int64_t tokens_per_step_;
  std::vector<Group> groups_;
  std::chrono::steady_clock::time_point start_;
  double comm0_ = 0;
  int64_t steps_ = 0;
};

// Rank 0 prints every rank's peak RSS added since `setup_rss` (activations and buffers).
void print_activation_memory(const Mesh& mesh, int64_t setup_rss);

}  // namespace ulysses::cli
