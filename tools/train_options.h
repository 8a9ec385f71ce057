// `ulysses train`'s options: the flags and their parse, the checks run before any rank starts,
// the mesh sizes they give, the learning-rate schedule, and the lines that describe a run.
#pragma once

#include <cstdint>
#include <string>

#include "args.h"
#include "model.h"
#include "train_data.h"
#include "ulysses/group.h"
#include "ulysses/ring_attention.h"

namespace ulysses::cli {

// What a `ulysses train` run does: train, or (--check) compare step 1 with one rank and exit.
enum class TrainRun { kTrain, kCheck };

// `ulysses train`'s options (each is the flag of the same name; ranges are checked by parse).
struct TrainOptions {
  int nproc = 4;                    // --nproc: local ranks to start, in [1, kMaxRanks].
  int sp = 0;                       // --sp: sequence-parallel size; 0: the world divided by dp.
  int dp = 0;                       // --dp: data-parallel size; 0: the world divided by sp.
  int ring = 1;                     // --ring: ring ranks R in each SP group (SP = Ulysses x R).
  int64_t seq_len = 256;            // --seq-len: tokens per sequence S, >= 1.
  int64_t batch = 16;               // --batch: sequences per DP rank and step, >= 1.
  int64_t steps = 400;              // --steps: optimiser steps in all, >= 0.
  int64_t pairs = 16;               // --pairs: key/value pairs per retrieval sequence, >= 1.
  double lr = 2.5e-3;               // --lr: peak learning rate, in [0, 10].
  double clip = 1.0;                // --clip: gradient-norm clip, >= 0; 0: none.
  double weight_decay = 0.01;       // --weight-decay: AdamW's, >= 0.
  int64_t warmup = 50;              // --warmup: linear warm-up steps, >= 0.
  int64_t decay_steps = 0;          // --lr-decay-steps: end of the cosine decay; 0: --steps.
  int64_t eval_every = 100;         // --eval-every: steps between held-out evaluations; 0: never.
  int64_t eval_sequences = 64;      // --eval-sequences: held-out sequences per evaluation, >= 1.
  int64_t log_every = 25;           // --log-every: steps per progress line, >= 1.
  uint64_t seed = 0;                // --seed: data and initialisation.
  std::string data;                 // --data: a text file to model (bytes); "": the retrieval task.
  std::string save;                 // --save: checkpoint written at the end; "": none.
  std::string resume;               // --resume: checkpoint to continue from; "": start fresh.
  TrainRun run = TrainRun::kTrain;  // --check: kCheck.
  bool shuffle = false;             // --shuffle: query the pairs in a random order (harder).
  ModelConfig model;                // --dim, --layers, --q-heads, --kv-heads, --ffn-dim, --tiled,
                                    // --checkpoint none|recompute|offload.
  GroupOptions group_options;       // --timeout.
};

// The options of `argv`; raises UsageError for a bad flag.
TrainOptions parse_train_options(const Argv& argv);
// The checks that need no rank, run before any rank starts: a bad command line exits 2 at once,
// not after every rank has started and joined. Returns the training data it checked, which a
// rank (or a world of one) then trains on: each process reads it once.
Data check_before_launch(const TrainOptions& o);
// The SP size from what the user gave: both sizes, one (the other derived), or neither (SP
// only). Throws naming the given sizes when they do not fit `world_size` ranks.
int sp_size_of(const TrainOptions& o, int world_size);
// Linear warm-up, then cosine decay to a tenth of --lr at --lr-decay-steps (default --steps):
// a function of the step alone, so a resumed run follows the uninterrupted run's schedule.
double learning_rate(const TrainOptions& o, int64_t step);

// The model and data as one line (a checkpoint must match it).
std::string config_line(const TrainOptions& o);
// The memory options in effect, as " (tiled, checkpoint offload)"; "" when none is.
std::string memory_line(const ModelConfig& m);
// The sequence split: Ulysses' contiguous shards, or the hybrid zigzag layout.
std::string describe(const RingLayout& layout);

}  // namespace ulysses::cli
