// `ulysses train --save / --resume`: crash-safe checkpoints of the model and the optimiser.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "model.h"
#include "train_options.h"
#include "ulysses/group.h"

namespace ulysses::cli {

// The checks of --save and --resume that need no rank (run before any starts): --save names a
// directory this user can create (it is made here) and write; --resume names a checkpoint whose
// state file matches this run's configuration and leaves steps to train. Raises
// c10::ValueError or UsageError.
void check_checkpoint_paths(const TrainOptions& o);
// Writes the checkpoint of `step` into o.save (rank 0 only; Note [Crash-safe checkpoints]).
void save_checkpoint(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o,
                     int64_t step);
// The step --resume continues from (0 without --resume). Every rank reads the checkpoint; a
// bad file raises the same error on every rank.
int64_t resume_step(Transformer& model, torch::optim::AdamW& optimizer, const TrainOptions& o,
                    const Group& world);

}  // namespace ulysses::cli
