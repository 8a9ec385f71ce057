#include "train_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"
#include "plan/fnv1a.h"

namespace ulysses::cli {
namespace {

// Note [Crash-safe checkpoints]: a checkpoint directory holds versioned files
// (model-<step>.pt, optimizer-<step>.pt) and state.txt, which names the current version with
// each file's size and FNV-1a hash. A save writes the new version's files, then replaces
// state.txt by an atomic rename (the commit point), then deletes older versions; a run killed at
// any point leaves state.txt naming a complete version. A load checks sizes and hashes first,
// so a truncated or corrupted file is a clear error naming it.
//
// Format versions (state.txt's first line): 2 hashes files with FNV-1a (src/plan/fnv1a.h); 1
// used an offset basis one digit short of FNV-1a's, which its checkpoints are still checked by.
constexpr const char* kCheckpointMagic = "ulysses-checkpoint 2";
constexpr const char* kCheckpointMagicV1 = "ulysses-checkpoint 1";
constexpr uint64_t kVersion1OffsetBasis = 1469598103934665603ull;

// The hash of `path`'s bytes, for a checkpoint of format `version`.
uint64_t file_hash(const std::filesystem::path& path, int version) {
  std::ifstream in(path, std::ios::binary);
  Fnv1a h = version == 1 ? Fnv1a(kVersion1OffsetBasis) : Fnv1a();
  char buf[1 << 16];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) h.add(buf, static_cast<size_t>(in.gcount()));
  return h.value();
}

// Flushes `path`'s contents to the disk, so a rename that follows never exposes a torn file.
void sync_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "train: cannot open '", path.string(), "' to sync it");
  ::fsync(fd);
  ::close(fd);
}

// state.txt's head: its format version and step, checked against this run's configuration.
// `in` is left at the file list. Errors name the file.
struct StateHead {
  int version = 0;
  int64_t step = -1;
};
StateHead read_state_head(std::ifstream& in, const TrainOptions& o) {
  namespace fs = std::filesystem;
  const fs::path dir(o.resume);
  std::error_code ec;
  TORCH_CHECK_VALUE(fs::is_directory(dir, ec), "train: --resume '", o.resume,
                    "' is not a checkpoint directory (",
                    fs::exists(dir, ec) ? "not a directory" : "it does not exist",
                    "); give the --save directory of an earlier run");
  in.open(dir / "state.txt");
  TORCH_CHECK_VALUE(in.good(), "train: no checkpoint in '", o.resume, "' (state.txt missing)");
  std::string magic, key, config;
  StateHead head;
  std::getline(in, magic);
  in >> key >> head.step;
  std::getline(in, config);  // Rest of the step line.
  std::getline(in, config);
  head.version = magic == kCheckpointMagic ? 2 : magic == kCheckpointMagicV1 ? 1 : 0;
  TORCH_CHECK_VALUE(
      head.version > 0 && key == "step" && head.step >= 0 && config.rfind("config ", 0) == 0,
      "train: '", (dir / "state.txt").string(),
      "' is not a ulysses checkpoint state file (or is corrupted)");
  config = config.substr(7);
  TORCH_CHECK_VALUE(config == config_line(o), "train: checkpoint '", o.resume, "' was saved with '",
                    config, "' but this run has '", config_line(o), "'");
  if (head.step >= o.steps) {
    throw UsageError("the checkpoint in '" + o.resume + "' is at step " +
                     std::to_string(head.step) + ": --steps " + std::to_string(o.steps) +
                     " leaves nothing to train (pass --steps > " + std::to_string(head.step) + ")");
  }
  return head;
}

// Reads and verifies the checkpoint in o.resume; returns its step. Errors name the file.
int64_t load_checkpoint(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o) {
  namespace fs = std::filesystem;
  const fs::path dir(o.resume);
  std::ifstream in;
  const StateHead head = read_state_head(in, o);
  const int version = head.version;
  const int64_t step = head.step;
  std::vector<fs::path> files;
  std::string key, name;
  uintmax_t size = 0;
  uint64_t hash = 0;
  while (in >> key >> name >> size >> std::hex >> hash >> std::dec && key == "file") {
    const fs::path path = dir / name;
    std::error_code ec;
    const uintmax_t actual = fs::file_size(path, ec);
    TORCH_CHECK_VALUE(!ec, "train: checkpoint file '", path.string(), "' is missing");
    TORCH_CHECK_VALUE(actual == size && file_hash(path, version) == hash,
                      "train: checkpoint file '", path.string(), "' is truncated or corrupted (",
                      actual, " bytes, expected ", size,
                      ", or its contents changed); resume from another checkpoint");
    files.push_back(path);
  }
  TORCH_CHECK_VALUE(files.size() == 2, "train: '", (dir / "state.txt").string(),
                    "' must name the model and optimizer files; it names ", files.size());
  torch::load(model, files[0].string());
  torch::load(optimizer, files[1].string());
  return step;
}

}  // namespace

void save_checkpoint(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o,
                     int64_t step) {
  namespace fs = std::filesystem;
  const fs::path dir(o.save);
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK_VALUE(!ec, "train: cannot create checkpoint directory '", o.save,
                    "': ", ec.message());
  const std::string model_name = "model-" + std::to_string(step) + ".pt";
  const std::string optim_name = "optimizer-" + std::to_string(step) + ".pt";
  torch::save(model, (dir / model_name).string());
  torch::save(optimizer, (dir / optim_name).string());
  std::ostringstream state;
  state << kCheckpointMagic << "\nstep " << step << "\nconfig " << config_line(o) << "\n";
  for (const std::string& name : {model_name, optim_name}) {
    sync_file(dir / name);
    state << "file " << name << " " << fs::file_size(dir / name) << " " << std::hex
          << file_hash(dir / name, 2) << std::dec << "\n";
  }
#ifdef ULYSSES_TEST_HOOKS
  // Test hook (builds with the tests only): die as a crash would, after the new files but
  // before the commit point.
  if (std::getenv("ULYSSES_TEST_CRASH_BEFORE_COMMIT")) std::_Exit(9);
#endif
  const fs::path tmp = dir / "state.txt.tmp";
  std::ofstream(tmp) << state.str();
  sync_file(tmp);
  fs::rename(tmp, dir / "state.txt");  // The commit point.
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool versioned = (name.rfind("model-", 0) == 0 || name.rfind("optimizer-", 0) == 0) &&
                           entry.path().extension() == ".pt";
    if (versioned && name != model_name && name != optim_name) fs::remove(entry.path(), ec);
  }
}

void check_checkpoint_paths(const TrainOptions& o) {
  namespace fs = std::filesystem;
  if (!o.save.empty()) {
    // The directory is made now (the run makes it anyway), and a file written and removed in
    // it: what the user may write is what the system lets this process do, root included.
    const fs::path dir(o.save);
    std::error_code ec;
    TORCH_CHECK_VALUE(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "train: --save '", o.save,
                      "' is a file, not a directory; give a directory for the checkpoint");
    fs::create_directories(dir, ec);
    TORCH_CHECK_VALUE(!ec, "train: --save '", o.save, "' cannot be made: ", ec.message(),
                      "; give a directory you can write");
    const fs::path probe = dir / ".ulysses-write-check";
    const bool writable = std::ofstream(probe).good();
    fs::remove(probe, ec);
    TORCH_CHECK_VALUE(writable, "train: --save '", o.save,
                      "' cannot be written by this user; give a directory you can write");
  }
  if (!o.resume.empty()) {
    std::ifstream in;
    read_state_head(in, o);
  }
}

int64_t resume_step(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o,
                    const Group& world) {
  if (o.resume.empty()) return 0;
  int64_t start = 0;
  world.agree([&] {
    start = load_checkpoint(model, optimizer, o);
    return std::vector<int64_t>{};
  });
  if (world.rank() == 0)
    std::cout << "resumed from " << o.resume << " at step " << start << std::endl;
  return start;
}

}  // namespace ulysses::cli
