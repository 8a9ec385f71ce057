// One step of `ulysses train`, and the model measured: against one rank running the whole
// batch (--check), and on held-out data.
#pragma once

#include <cstdint>

#include "model.h"
#include "train_options.h"
#include "ulysses/mesh.h"
#include "ulysses/ring_attention.h"
#include "ulysses/sharding.h"

namespace ulysses::cli {

// The rows of the largest sequence shard: every rank's tile counts follow from it.
int64_t longest_shard(const RingLayout& seq);
// One sharded forward and backward; gradients reduced over the world. Returns the loss.
// `longest`: longest_shard of the layout, the same every step.
ShardedLoss forward_backward(Transformer& model, const TokenBatch& shard, const Mesh& mesh,
                             int64_t longest);
// --check: step 1's loss and every gradient against one rank running the whole global batch;
// rank 0 prints the verdict. Returns the exit code (0: PASS).
int run_check(Transformer& model, const TrainOptions& o, const Data& data, const Mesh& mesh,
              const RingLayout& seq);
// Held-out accuracy on the scored targets (the retrieval answers; every next byte for text).
double evaluate(Transformer& model, const TrainOptions& o, const Data& data, const Mesh& mesh,
                const RingLayout& seq, int64_t step);

}  // namespace ulysses::cli
