// `ulysses train`: sequence-parallel training of a GQA transformer on local ranks.
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "args.h"
#include "commands.h"
#include "model.h"
#include "proc_status.h"
#include "train_data.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/mesh.h"
#include "ulysses/sharding.h"

namespace ulysses::cli {
namespace {

// `ulysses train`'s options (each is the flag of the same name; ranges are checked by parse).
struct TrainOptions {
  int nproc = 4;                // --nproc: local ranks to start, in [1, kMaxRanks].
  int sp = 0;                   // --sp: sequence-parallel size; 0: the world divided by dp.
  int dp = 0;                   // --dp: data-parallel size; 0: the world divided by sp.
  int ring = 1;                 // --ring: ring ranks R in each SP group (SP = Ulysses x R).
  int64_t seq_len = 256;        // --seq-len: tokens per sequence S, >= 1.
  int64_t batch = 16;           // --batch: sequences per DP rank and step, >= 1.
  int64_t steps = 400;          // --steps: optimiser steps in all, >= 0.
  int64_t pairs = 16;           // --pairs: key/value pairs per retrieval sequence, >= 1.
  double lr = 5e-3;             // --lr: peak learning rate, in [0, 10].
  double clip = 1.0;            // --clip: gradient-norm clip, >= 0; 0: none.
  double weight_decay = 0.01;   // --weight-decay: AdamW's, >= 0.
  int64_t warmup = 50;          // --warmup: linear warm-up steps, >= 0.
  int64_t decay_steps = 0;      // --lr-decay-steps: end of the cosine decay; 0: --steps.
  int64_t eval_every = 100;     // --eval-every: steps between held-out evaluations; 0: never.
  int64_t eval_sequences = 64;  // --eval-sequences: held-out sequences per evaluation, >= 1.
  int64_t log_every = 25;       // --log-every: steps per progress line, >= 1.
  uint64_t seed = 0;            // --seed: data and initialisation.
  std::string data;             // --data: a text file to model (bytes); "": the retrieval task.
  std::string save;             // --save: checkpoint written at the end; "": none.
  std::string resume;           // --resume: checkpoint to continue from; "": start fresh.
  bool check = false;           // --check: step 1's loss and gradients vs one rank, then exit.
  bool shuffle = false;         // --shuffle: query the pairs in a random order (harder).
  ModelConfig model;            // --dim, --layers, --q-heads, --kv-heads, --ffn-dim, --tiled,
                                // --checkpoint none|recompute|offload.
  GroupOptions group;           // --timeout.
};

std::string mb(int64_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(0) << bytes / 1048576.0;
  return os.str();
}

// The training data, whichever source was chosen.
class Data {
 public:
  explicit Data(const TrainOptions& o) {
    if (o.data.empty()) {
      retrieval_ = std::make_unique<RetrievalTask>(o.seq_len, o.pairs, o.shuffle, o.seed);
    } else {
      text_ = std::make_unique<TextData>(o.data, o.seq_len, o.seed);
    }
  }
  int64_t vocab() const { return retrieval_ ? retrieval_->vocab() : text_->vocab(); }
  TokenBatch batch(int split, int64_t step, int64_t first, int64_t count) const {
    return retrieval_ ? retrieval_->batch(split, step, first, count)
                      : text_->batch(split, step, first, count);
  }
  bool is_retrieval() const { return retrieval_ != nullptr; }

 private:
  std::unique_ptr<RetrievalTask> retrieval_;
  std::unique_ptr<TextData> text_;
};

// The sequence split: Ulysses' contiguous shards, or the hybrid zigzag layout.
std::string describe(const RingLayout& layout) {
  std::ostringstream os;
  if (layout.ring() == 1) {
    os << SequencePartition::even(layout.seq_len(), layout.ulysses());
  } else {
    os << "ulysses " << layout.ulysses() << " x ring " << layout.ring()
       << ", zigzag tokens per ring rank [";
    for (int64_t r = 0; r < layout.ring(); ++r) os << (r ? ", " : "") << layout.ring_length(r);
    os << "]";
  }
  return os.str();
}

// The memory options in effect, as " (tiled, checkpoint offload)"; "" when none is.
std::string memory_line(const ModelConfig& m) {
  static const char* kNames[] = {"none", "recompute", "offload"};
  std::vector<std::string> parts;
  if (m.tiled) parts.push_back("tiled");
  if (m.checkpoint != Checkpoint::kNone)
    parts.push_back(std::string("checkpoint ") + kNames[static_cast<int>(m.checkpoint)]);
  if (m.local != LocalKernel::kAuto) parts.push_back("local " + to_string(m.local));
  if (parts.empty()) return "";
  std::string line;
  for (const std::string& p : parts) line += (line.empty() ? "" : ", ") + p;
  return " (" + line + ")";
}

std::string config_line(const TrainOptions& o) {
  const ModelConfig& m = o.model;
  std::ostringstream os;
  os << "vocab=" << m.vocab << " dim=" << m.dim << " layers=" << m.layers
     << " q_heads=" << m.q_heads << " kv_heads=" << m.kv_heads << " hidden=" << m.hidden()
     << " seq_len=" << o.seq_len
     << " data=" << (o.data.empty() ? (o.shuffle ? "retrieval-shuffled" : "retrieval") : o.data);
  return os.str();
}

// The rows of the largest sequence shard: every rank's tile counts follow from it.
int64_t longest_shard(const RingLayout& seq) {
  int64_t rows = 0;
  for (int64_t p = 0; p < seq.sp_size(); ++p) rows = std::max(rows, seq.shard_index(p).numel());
  return rows;
}

// One sharded forward and backward; gradients reduced over the world. Returns the loss.
// `longest`: longest_shard of the layout, the same every step.
ShardedLoss forward_backward(Transformer& model, const TokenBatch& shard, const Mesh& mesh,
                             int64_t longest) {
  StepContext context(mesh.ulysses);
  ShardedLoss loss = model->loss(shard, mesh.world, &context, longest);
  loss.loss.backward();
  all_reduce_gradients(gradients_of(model->parameters()), mesh.world);
  return loss;
}

// --check: step 1's loss and every gradient against one rank running the whole global batch.
int run_check(Transformer& model, const TrainOptions& o, const Data& data, const Mesh& mesh,
              const RingLayout& seq) {
  const int dp = mesh.dp.size();
  const TokenBatch local = data.batch(0, 0, mesh.dp.rank() * o.batch, o.batch);
  model->zero_grad();
  const ShardedLoss ours =
      forward_backward(model, shard_batch(local, seq, mesh.sp.rank()), mesh, longest_shard(seq));

  Group solo = Group::solo();
  ModelConfig plain = o.model;  // The reference holds every activation: no tiles, no recompute.
  plain.tiled = false;
  plain.checkpoint = Checkpoint::kNone;
  Transformer reference(plain, solo, o.seed);
  const TokenBatch global = data.batch(0, 0, 0, o.batch * dp);
  const TokenBatch whole = shard_batch(global, SequencePartition::even(o.seq_len, 1), 0);
  at::Tensor logits = reference->forward(whole.input_ids, whole.position_ids);
  ShardedLoss ref = sharded_cross_entropy(logits, whole.labels, solo);
  ref.loss.backward();

  double worst = std::abs(ours.global_loss - ref.global_loss) / std::abs(ref.global_loss);
  std::string worst_name = "loss";
  auto ref_params = reference->named_parameters();
  for (const auto& p : model->named_parameters()) {
    const at::Tensor& g = p.value().grad();
    const at::Tensor& r = ref_params[p.key()].grad();
    const double err = (g - r).abs().max().item<double>() / r.abs().max().item<double>();
    if (err > worst) worst = err, worst_name = p.key();
  }
  at::Tensor w = at::tensor({worst}, at::kDouble);
  at::Tensor all = mesh.world.all_gather(w);
  const double max_err = all.max().item<double>();
  const bool pass = max_err <= 1e-4;
  if (mesh.world.rank() == 0) {
    std::cout << std::setprecision(6) << "check: world " << mesh.world.size() << " (sp "
              << mesh.sp.size() << " x dp " << dp << "), seq_len " << o.seq_len << " "
              << describe(seq) << memory_line(o.model) << "\n"
              << "check: loss " << ours.global_loss << " vs single-rank " << ref.global_loss << "\n"
              << "check: max relative error over loss and " << model->parameters().size()
              << " gradients: " << std::scientific << max_err << " (rank 0 worst: " << worst_name
              << ")\n"
              << (pass ? "PASS" : "FAIL") << std::endl;
  }
  return pass ? 0 : 1;
}

// Held-out accuracy on the scored targets (the retrieval answers; every next byte for text).
double evaluate(Transformer& model, const TrainOptions& o, const Data& data, const Mesh& mesh,
                const RingLayout& seq, int64_t step) {
  torch::NoGradGuard no_grad;
  const int64_t per_replica = std::max<int64_t>(1, o.eval_sequences / mesh.dp.size());
  at::Tensor counts = at::zeros({2}, at::kDouble);
  for (int64_t i = 0; i < per_replica; i += o.batch) {
    const int64_t n = std::min(o.batch, per_replica - i);
    TokenBatch shard =
        shard_batch(data.batch(1, step, mesh.dp.rank() * per_replica + i, n), seq, mesh.sp.rank());
    StepContext context(mesh.ulysses);
    at::Tensor pred = model->forward(shard.input_ids, shard.position_ids, &context).argmax(-1);
    at::Tensor scored = shard.labels.ne(kIgnoreIndex);
    counts[0] += pred.eq(shard.labels).logical_and(scored).sum().item<double>();
    counts[1] += scored.sum().item<double>();
  }
  mesh.world.all_reduce_sum(counts);
  return counts[1].item<double>() > 0 ? counts[0].item<double>() / counts[1].item<double>() : 0;
}

// Note [Crash-safe checkpoints]: a checkpoint directory holds versioned files
// (model-<step>.pt, optimizer-<step>.pt) and state.txt, which names the current version with
// each file's size and FNV-1a hash. A save writes the new version's files, then replaces
// state.txt by an atomic rename (the commit point), then deletes older versions; a run killed at
// any point leaves state.txt naming a complete version. A load checks sizes and hashes first,
// so a truncated or corrupted file is a clear error naming it.
constexpr const char* kCheckpointMagic = "ulysses-checkpoint 1";

uint64_t file_hash(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t h = 1469598103934665603ull;
  char buf[1 << 16];
  while (in.read(buf, sizeof(buf)) || in.gcount() > 0) {
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      h = (h ^ static_cast<unsigned char>(buf[i])) * 1099511628211ull;
    }
  }
  return h;
}

// Flushes `path`'s contents to the disk, so a rename that follows never exposes a torn file.
void sync_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "train: cannot open '", path.string(), "' to sync it");
  ::fsync(fd);
  ::close(fd);
}

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
          << file_hash(dir / name) << std::dec << "\n";
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

// Reads and verifies the checkpoint in o.resume; returns its step. Errors name the file.
int64_t load_checkpoint(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o) {
  namespace fs = std::filesystem;
  const fs::path dir(o.resume);
  std::ifstream in(dir / "state.txt");
  TORCH_CHECK_VALUE(in.good(), "train: no checkpoint in '", o.resume, "' (state.txt missing)");
  std::string magic, key, config;
  int64_t step = -1;
  std::getline(in, magic);
  in >> key >> step;
  std::getline(in, config);  // Rest of the step line.
  std::getline(in, config);
  TORCH_CHECK_VALUE(
      magic == kCheckpointMagic && key == "step" && step >= 0 && config.rfind("config ", 0) == 0,
      "train: '", (dir / "state.txt").string(),
      "' is not a ulysses checkpoint state file (or is corrupted)");
  config = config.substr(7);
  TORCH_CHECK_VALUE(config == config_line(o), "train: checkpoint '", o.resume, "' was saved with '",
                    config, "' but this run has '", config_line(o), "'");
  std::vector<fs::path> files;
  std::string name;
  uintmax_t size = 0;
  uint64_t hash = 0;
  while (in >> key >> name >> size >> std::hex >> hash >> std::dec && key == "file") {
    const fs::path path = dir / name;
    std::error_code ec;
    const uintmax_t actual = fs::file_size(path, ec);
    TORCH_CHECK_VALUE(!ec, "train: checkpoint file '", path.string(), "' is missing");
    TORCH_CHECK_VALUE(actual == size && file_hash(path) == hash, "train: checkpoint file '",
                      path.string(), "' is truncated or corrupted (", actual, " bytes, expected ",
                      size, ", or its contents changed); resume from another checkpoint");
    files.push_back(path);
  }
  TORCH_CHECK_VALUE(files.size() == 2, "train: '", (dir / "state.txt").string(),
                    "' must name the model and optimizer files; it names ", files.size());
  torch::load(model, files[0].string());
  torch::load(optimizer, files[1].string());
  return step;
}

std::string number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

const Options& train_options() {
  // TrainOptions' defaults; the model's are the CLI's own: the default model learns the default
  // task's retrieval (held-out accuracy >= 0.99) within the default 400 steps.
  static const Options options = [] {
    const TrainOptions d;
    using std::to_string;
    return with({value("--nproc", to_string(d.nproc)).in(1, kMaxRanks),
                 placeholder("--sp", "P").in(1, kMaxRanks),
                 placeholder("--dp", "D").in(1, kMaxRanks),
                 value("--ring", to_string(d.ring)).in(1, kMaxRanks),
                 value("--seq-len", to_string(d.seq_len)).in(1),
                 value("--batch", to_string(d.batch)).in(1),
                 value("--steps", to_string(d.steps)).in(1),
                 value("--dim", "128").in(2),
                 value("--layers", to_string(d.model.layers)).in(1),
                 value("--q-heads", "8").in(1, kMaxHeads),
                 value("--kv-heads", "2").in(1, kMaxHeads),
                 value("--ffn-dim", "0").in(0),
                 flag("--tiled"),
                 choice("--checkpoint", "none|recompute|offload", "none"),
                 choice("--local", "auto|fused|sdpa|math", "auto"),
                 value("--lr", number(d.lr)).real_in(0.0, 10.0),
                 value("--warmup", to_string(d.warmup)).in(0),
                 placeholder("--lr-decay-steps", "STEPS").in(1),
                 value("--weight-decay", number(d.weight_decay)).real_in(0.0),
                 value("--clip", number(d.clip)).real_in(0.0),
                 value("--pairs", to_string(d.pairs)).in(1),
                 flag("--shuffle"),
                 placeholder("--data", "FILE"),
                 value("--eval-every", to_string(d.eval_every)).in(0),
                 value("--eval-sequences", to_string(d.eval_sequences)).in(1),
                 value("--log-every", to_string(d.log_every)).in(1),
                 value("--seed", to_string(d.seed)).in(0),
                 flag("--check"),
                 placeholder("--save", "DIR"),
                 placeholder("--resume", "DIR")},
                group_option_table());
  }();
  return options;
}

namespace {

TrainOptions parse(const Argv& argv) {
  const Args args(argv, train_options());
  TrainOptions o;
  o.nproc = static_cast<int>(args.integer("--nproc"));
  o.sp = args.has("--sp") ? static_cast<int>(args.integer("--sp")) : 0;
  o.dp = args.has("--dp") ? static_cast<int>(args.integer("--dp")) : 0;
  o.ring = static_cast<int>(args.integer("--ring"));
  o.seq_len = args.integer("--seq-len");
  o.batch = args.integer("--batch");
  o.steps = args.integer("--steps");
  o.pairs = args.integer("--pairs");
  o.lr = args.real("--lr");
  o.clip = args.real("--clip");
  o.weight_decay = args.real("--weight-decay");
  o.warmup = args.integer("--warmup");
  o.eval_every = args.integer("--eval-every");
  o.log_every = args.integer("--log-every");
  o.decay_steps = args.has("--lr-decay-steps") ? args.integer("--lr-decay-steps") : 0;
  o.eval_sequences = args.integer("--eval-sequences");
  o.seed = static_cast<uint64_t>(args.integer("--seed"));
  o.data = args.str("--data");
  o.save = args.str("--save");
  o.resume = args.str("--resume");
  o.check = args.has("--check");
  o.shuffle = args.has("--shuffle");
  o.model.dim = args.integer("--dim");
  o.model.layers = args.integer("--layers");
  o.model.q_heads = args.integer("--q-heads");
  o.model.kv_heads = args.integer("--kv-heads");
  o.model.ffn_dim = args.integer("--ffn-dim");
  o.model.tiled = args.has("--tiled");
  try {
    o.model.local = parse_local_kernel(args.str("--local"));
  } catch (const c10::Error&) {
    throw UsageError("option --local must be auto, fused, sdpa or math; got '" +
                     args.str("--local") + "'");
  }
  const std::string checkpoint = args.str("--checkpoint");
  if (checkpoint == "none") {
    o.model.checkpoint = Checkpoint::kNone;
  } else if (checkpoint == "recompute") {
    o.model.checkpoint = Checkpoint::kRecompute;
  } else if (checkpoint == "offload") {
    o.model.checkpoint = Checkpoint::kOffload;
  } else {
    throw UsageError("option --checkpoint must be none, recompute or offload; got '" + checkpoint +
                     "'");
  }
  o.group = group_options(args);
  return o;
}

// The SP size from what the user gave: both sizes, one (the other derived), or neither (SP
// only). Throws naming the given sizes when they do not fit `world_size` ranks.
int sp_size_of(const TrainOptions& o, int world_size) {
  const int W = world_size;
  if (o.sp > 0 && o.dp > 0) {
    TORCH_CHECK_VALUE(o.sp * o.dp == W, "train: --sp ", o.sp, " x --dp ", o.dp,
                      " must equal the number of ranks (", W, ")");
  } else if (o.dp > 0) {
    TORCH_CHECK_VALUE(W % o.dp == 0, "train: --dp ", o.dp, " must divide the number of ranks (", W,
                      "); the SP size is derived as ranks / --dp");
  } else if (o.sp > 0) {
    TORCH_CHECK_VALUE(W % o.sp == 0, "train: --sp ", o.sp, " must divide the number of ranks (", W,
                      "); the DP size is derived as ranks / --sp");
  }
  return o.sp > 0 ? o.sp : o.dp > 0 ? W / o.dp : W;
}

// The checks that need no rank, run before any rank starts: a bad command line exits 2 at once,
// not after every rank has started and joined. Returns the training data it checked, which a
// rank (or a world of one) then trains on: each process reads it once.
Data check_before_launch(const TrainOptions& o) {
  const char* world_env = std::getenv("WORLD_SIZE");
  const int world = std::getenv("RANK") && world_env ? std::atoi(world_env) : o.nproc;
  try {
    const int sp = sp_size_of(o, world);
    TORCH_CHECK_VALUE(sp % o.ring == 0, "train: --ring ", o.ring,
                      " must divide the sequence-parallel size (", sp, ")");
    TORCH_CHECK_VALUE(o.model.q_heads % o.model.kv_heads == 0, "train: --q-heads ", o.model.q_heads,
                      " must be a multiple of --kv-heads ", o.model.kv_heads);
    TORCH_CHECK_VALUE(o.model.dim % o.model.q_heads == 0 && o.model.head_dim() % 2 == 0,
                      "train: --dim ", o.model.dim, " must split into ", o.model.q_heads,
                      " heads of an even size");
    return Data(o);  // The task's rules, or the --data file's.
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    if (what.rfind("train: ", 0) == 0) what.erase(0, 7);
    throw UsageError(what);
  }
}

// The step --resume continues from (0 without --resume). Every rank reads the checkpoint; a
// bad file raises the same error on every rank.
int64_t resume_step(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o,
                    const Group& world) {
  if (o.resume.empty()) return 0;
  int64_t start = 0;
  world.agree([&] {
    start = load_checkpoint(model, optimizer, o);
    return std::vector<int64_t>{};
  });
  if (start >= o.steps) {
    throw UsageError("the checkpoint in '" + o.resume + "' is at step " + std::to_string(start) +
                     ": --steps " + std::to_string(o.steps) +
                     " leaves nothing to train (pass --steps > " + std::to_string(start) + ")");
  }
  if (world.rank() == 0)
    std::cout << "resumed from " << o.resume << " at step " << start << std::endl;
  return start;
}

// Linear warm-up, then cosine decay to a tenth of --lr at --lr-decay-steps (default --steps):
// a function of the step alone, so a resumed run follows the uninterrupted run's schedule.
double learning_rate(const TrainOptions& o, int64_t step) {
  const int64_t horizon = o.decay_steps > 0 ? o.decay_steps : o.steps;
  const double warm = std::min(1.0, (step + 1.0) / std::max<int64_t>(1, o.warmup));
  const double progress =
      std::min(1.0, static_cast<double>(step) / std::max<int64_t>(1, horizon - 1));
  return o.lr * warm * (0.1 + 0.45 * (1.0 + std::cos(M_PI * progress)));
}

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
void print_activation_memory(const Mesh& mesh, int64_t setup_rss) {
  const int64_t activation = proc_status_bytes("VmHWM") - setup_rss;
  at::Tensor act = mesh.world.all_gather(at::tensor({activation}, at::kLong));
  if (mesh.world.rank() != 0) return;
  std::cout << "activation memory per rank (peak RSS - RSS after setup), MB:";
  for (int r = 0; r < mesh.world.size(); ++r) std::cout << " " << mb(act[r].item<int64_t>());
  std::cout << std::endl;
}

}  // namespace

int train_main(const Argv& argv, const Runtime& runtime) {
  TrainOptions o = parse(argv);
  const Data data = check_before_launch(o);
  const int code = relaunch_as_ranks(o.nproc, runtime.self, {"train"}, argv);
  if (code >= 0) return code;

  // Ranks of this machine share its cores.
  const int local_ranks = std::max(
      1, std::atoi(std::getenv("LOCAL_WORLD_SIZE") ? std::getenv("LOCAL_WORLD_SIZE") : "1"));
  at::set_num_threads(std::max<int>(1, std::thread::hardware_concurrency() / local_ranks));
  Group world = runtime.join_world(o.group);
  Mesh mesh = Mesh::create(world, sp_size_of(o, world.size()), runtime.split, o.ring);
  const bool lead = world.rank() == 0;
  o.model.vocab = data.vocab();
  const RingLayout seq = RingLayout::make(o.seq_len, mesh.ulysses.size(), mesh.ring.size());

  Transformer model(o.model, mesh.ulysses, o.seed, mesh.ring);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  if (lead) {
    std::cout << "model: " << config_line(o) << ", " << params << " parameters"
              << memory_line(o.model) << "\n"
              << "mesh: world " << world.size() << " = sp " << mesh.sp.size() << " x dp "
              << mesh.dp.size() << "; " << describe(seq) << "; " << at::get_num_threads()
              << " threads/rank" << std::endl;
  }
  if (o.check) return run_check(model, o, data, mesh, seq);

  const int64_t start = resume_step(model, optimizer, o, world);
  const int64_t setup_rss = proc_status_bytes("VmRSS");
  ProgressLog progress(mesh, o.batch * o.seq_len * mesh.dp.size());
  const int64_t longest = longest_shard(seq);
  for (int64_t step = start; step < o.steps; ++step) {
    for (auto& group : optimizer.param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(o, step));
    optimizer.zero_grad();
    const TokenBatch local = data.batch(0, step, mesh.dp.rank() * o.batch, o.batch);
    const ShardedLoss loss =
        forward_backward(model, shard_batch(local, seq, mesh.sp.rank()), mesh, longest);
    if (o.clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), o.clip);
    optimizer.step();
    progress.step_done();
    const bool last = step + 1 == o.steps;
    if (step == start || last || (step + 1) % o.log_every == 0) {
      progress.print(step + 1, o.steps, loss.global_loss);
    }
    if (o.eval_every > 0 && ((step + 1) % o.eval_every == 0 || last)) {
      const double acc = evaluate(model, o, data, mesh, seq, step);
      if (lead) {
        std::cout << "eval step " << step + 1 << ": held-out "
                  << (data.is_retrieval() ? "retrieval" : "next-byte") << " accuracy "
                  << std::setprecision(3) << acc << std::endl;
      }
    }
  }
  print_activation_memory(mesh, setup_rss);
  if (!o.save.empty()) {
    if (lead) save_checkpoint(model, optimizer, o, o.steps);
    world.barrier();
    if (lead) std::cout << "saved checkpoint at step " << o.steps << " to " << o.save << std::endl;
  }
  return 0;
}

}  // namespace ulysses::cli
