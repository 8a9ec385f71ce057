// `ulysses train`: sequence-parallel training of a GQA transformer on local ranks. Its parts:
// train_options (flags, checks, schedule), train_step (the step, --check, evaluation),
// train_checkpoint (--save, --resume), train_progress (the progress lines).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "args.h"
#include "commands.h"
#include "model.h"
#include "proc_status.h"
#include "train_checkpoint.h"
#include "train_data.h"
#include "train_options.h"
#include "train_progress.h"
#include "train_step.h"
#include "ulysses/mesh.h"
#include "ulysses/sharding.h"

namespace ulysses::cli {

int train_main(const Argv& argv, const Runtime& runtime) {
  TrainOptions o = parse_train_options(argv);
  const Data data = check_before_launch(o);
  const int code = relaunch_as_ranks(o.nproc, runtime.self, {"train"}, argv);
  if (code >= 0) return code;

  // Ranks of this machine share its cores.
  const int local_ranks = std::max(
      1, std::atoi(std::getenv("LOCAL_WORLD_SIZE") ? std::getenv("LOCAL_WORLD_SIZE") : "1"));
  at::set_num_threads(std::max<int>(1, std::thread::hardware_concurrency() / local_ranks));
  Group world = runtime.join_world(o.group_options);
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
  if (o.run == TrainRun::kCheck) return run_check(model, o, data, mesh, seq);

  const int64_t start = resume_step(model, optimizer, o, world);
  const int64_t setup_rss = proc_status_bytes("VmRSS");
  ProgressLog progress(mesh, o.batch * o.seq_len * mesh.dp.size());
  const int64_t longest = longest_shard(seq);
#ifdef ULYSSES_TEST_HOOKS
  // Test hook (builds with the tests only): the last rank starts step 3 this many milliseconds
  // late, as a rank held up by a checkpoint or an evaluation would.
  const char* late_ms = std::getenv("ULYSSES_TEST_LAST_RANK_LATE_MS");
#endif
  for (int64_t step = start; step < o.steps; ++step) {
#ifdef ULYSSES_TEST_HOOKS
    if (late_ms != nullptr && step == 2 && world.rank() == world.size() - 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(late_ms)));
#endif
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
