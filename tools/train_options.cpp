#include "train_options.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "commands.h"
#include "train_checkpoint.h"
#include "ulysses/mesh_plan.h"
#include "ulysses/partition.h"

namespace ulysses::cli {
namespace {

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

TrainOptions parse_train_options(const Argv& argv) {
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
  o.run = args.has("--check") ? TrainRun::kCheck : TrainRun::kTrain;
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
  try {
    o.model.checkpoint = parse_checkpoint(args.str("--checkpoint"));
  } catch (const c10::Error&) {
    throw UsageError("option --checkpoint must be none, recompute or offload; got '" +
                     args.str("--checkpoint") + "'");
  }
  o.group_options = group_options(args);
  return o;
}

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

Data check_before_launch(const TrainOptions& o) {
  const int world = ranks_to_run(o.nproc);
  try {
    const int sp = sp_size_of(o, world);
    check_mesh_sizes(world, sp, o.ring, "train");
    check_head_counts(o.model.q_heads, o.model.kv_heads, "train: ", "--q-heads", "--kv-heads");
    TORCH_CHECK_VALUE(o.model.dim % o.model.q_heads == 0 && o.model.head_dim() % 2 == 0,
                      "train: --dim ", o.model.dim, " must split into ", o.model.q_heads,
                      " heads of an even size");
    Data data(o.data, o.seq_len, o.pairs, o.shuffle,
              o.seed);  // The task's rules, or the --data file's.
    TrainOptions run = o;
    run.model.vocab = data.vocab();  // (what a checkpoint's configuration line names)
    check_checkpoint_paths(run);
    return data;
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    if (what.rfind("train: ", 0) == 0) what.erase(0, 7);
    throw UsageError(what);
  }
}

double learning_rate(const TrainOptions& o, int64_t step) {
  const int64_t horizon = o.decay_steps > 0 ? o.decay_steps : o.steps;
  const double warm = std::min(1.0, (step + 1.0) / std::max<int64_t>(1, o.warmup));
  const double progress =
      std::min(1.0, static_cast<double>(step) / std::max<int64_t>(1, horizon - 1));
  return o.lr * warm * (0.1 + 0.45 * (1.0 + std::cos(M_PI * progress)));
}

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

std::string memory_line(const ModelConfig& m) {
  std::vector<std::string> parts;
  if (m.tiled) parts.push_back("tiled");
  if (m.checkpoint != Checkpoint::kNone) parts.push_back("checkpoint " + to_string(m.checkpoint));
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

}  // namespace ulysses::cli
