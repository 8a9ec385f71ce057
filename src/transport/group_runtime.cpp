#include "transport/group_runtime.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <new>
#include <vector>

namespace ulysses {

BufferCache::~BufferCache() {
  for (const Entry& e : free_) std::free(e.p);
}

void* BufferCache::take(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {  // Newest first.
      if (it->bytes != bytes) continue;
      void* p = it->p;
      free_.erase(it);
      cached_ -= static_cast<int64_t>(bytes);
      return p;
    }
  }
  void* p = nullptr;
  if (posix_memalign(&p, 64, std::max<size_t>(bytes, 64)) != 0) throw std::bad_alloc();
  return p;
}

void BufferCache::give_back(void* p, size_t bytes) {
  if (static_cast<int64_t>(bytes) > limit_) {
    std::free(p);
    return;
  }
  std::vector<void*> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_front({bytes, p});
    cached_ += static_cast<int64_t>(bytes);
    while (cached_ > limit_) {
      evicted.push_back(free_.back().p);
      cached_ -= static_cast<int64_t>(free_.back().bytes);
      free_.pop_back();
    }
  }
  for (void* q : evicted) std::free(q);  // Outside the lock: returning pages takes time.
}

int64_t BufferCache::cached() {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

GroupRuntime::GroupRuntime(int64_t cache_bytes)
    : buffers(std::make_shared<BufferCache>(cache_bytes)) {}

GroupRuntime::~GroupRuntime() = default;

std::shared_ptr<GroupRuntime> GroupRuntime::of(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                               int64_t cache_bytes) {
  struct Entry {
    c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
    std::shared_ptr<GroupRuntime> runtime;
  };
  static std::mutex mu;
  static std::map<const c10d::ProcessGroup*, Entry> entries;  // Guarded by mu.
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = entries.begin(); it != entries.end();) {
    it = it->second.group.expired() ? entries.erase(it) : std::next(it);
  }
  auto it = entries.find(pg.get());
  if (it != entries.end()) return it->second.runtime;
  auto runtime = std::make_shared<GroupRuntime>(cache_bytes);
  entries.emplace(pg.get(), Entry{c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg), runtime});
  return runtime;
}

detail::SharedMemoryLinks& GroupRuntime::links(const Group& group) {
  std::lock_guard<std::mutex> lock(links_mu_);
  if (!links_) links_ = std::make_unique<detail::SharedMemoryLinks>(group);
  return *links_;
}

}  // namespace ulysses
