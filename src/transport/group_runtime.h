// The state every handle of one process group shares (Group::runtime()), kept per live
// c10d::ProcessGroup: its cache of freed buffers, its recorder, its shared-memory links and the
// agreement its attention calls may reuse. c10d keeps its own registry of groups; this is ours
// beside it, entries of destroyed groups dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>

#include "transport/agreement.h"
#include "transport/shared_memory.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/group.h"

namespace ulysses {

// Freed buffers, reused by later requests of the same byte size (training steps repeat their
// shapes). Holds at most GroupOptions::buffer_cache_bytes, evicting the least recently freed
// buffers first, so sizes a step no longer uses (another sequence length) make room for the
// ones it does. Thread-safe.
class BufferCache {
 public:
  explicit BufferCache(int64_t limit) : limit_(limit) {}
  ~BufferCache();
  BufferCache(const BufferCache&) = delete;
  BufferCache& operator=(const BufferCache&) = delete;
  void* take(size_t bytes);
  void give_back(void* p, size_t bytes);
  int64_t cached();

 private:
  struct Entry {
    size_t bytes;
    void* p;
  };
  std::mutex mu_;
  std::list<Entry> free_;  // Most recently freed first; guarded by mu_.
  int64_t cached_ = 0;     // Bytes in free_; <= limit_ outside give_back.
  const int64_t limit_;
};

class GroupRuntime {
 public:
  // The runtime of `pg` (made on its first use, with a cache of at most `cache_bytes`).
  static std::shared_ptr<GroupRuntime> of(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                          int64_t cache_bytes);
  explicit GroupRuntime(int64_t cache_bytes);
  ~GroupRuntime();

  // The group's shared-memory links, set up by its first exchange that uses them (two
  // all_gathers every rank of `group`, this runtime's, issues at the same point).
  detail::SharedMemoryLinks& links(const Group& group);

  std::shared_ptr<BufferCache> buffers;  // Shared with the deleters of tensors it lent.
  CollectiveRecorder recorder;
  detail::ArmedAgreement armed;  // Note [Reused agreement].

 private:
  std::mutex links_mu_;
  std::unique_ptr<detail::SharedMemoryLinks> links_;  // Set up on first use; guarded.
};

}  // namespace ulysses
