// Every message tag in use between two ranks of a group, in one place so a new one is picked
// knowing the others. Transfers of one tag between two ranks arrive in order (Transfers).
#pragma once

namespace ulysses::detail {

enum MessageTag : int {
  kRingKeyValues = 1,          // Ring attention: key/value blocks (attention/ring_attention.cpp).
  kRingGradients = 2,          // Ring attention: their gradient accumulators.
  kSharedMemoryPacked = 8,     // Shared memory: "my blocks for you are packed" (shared_memory.h).
  kSharedMemoryRead = 9,       // Shared memory: "I have read your blocks".
  kSharedMemoryFallback = 10,  // Shared memory: my blocks for you, as one message (no outbox).
  kFirstMessage = 16,          // Pipelined messages: message i of a transfer has tag 16 + i.
};

}  // namespace ulysses::detail
