#include "train_progress.h"

namespace ulysses::cli {

std::string mb(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(0) << bytes / 1048576.0;
  return os.str();
}

void print_activation_memory(const Mesh& mesh, int64_t setup_rss) {
  const int64_t activation = proc_status_bytes("VmHWM") - setup_rss;
  at::Tensor act = mesh.world.all_gather(at::tensor({activation}, at::kLong));
  if (mesh.world.rank() != 0) return;
  std::cout << "activation memory per rank (peak RSS - RSS after setup), MB:";
  for (int r = 0; r < mesh.world.size(); ++r) std::cout << " " << mb(act[r].item<int64_t>());
  std::cout << std::endl;
}

}  // namespace ulysses::cli
