#include "transport/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>

#include "ulysses/group.h"

namespace ulysses::detail {

int64_t boot_key() {
  static const int64_t key = [] {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string boot;
    std::getline(f, boot);
    return boot.empty() ? int64_t{0} : static_cast<int64_t>(std::hash<std::string>{}(boot));
  }();
  return key;
}

namespace {

// What two ranks must share to map each other's outboxes as one host: [usable, boot, /dev/shm's
// device and inode, network namespace inode]. usable = 0 where any of them cannot be read.
std::vector<int64_t> host_key() {
  const int64_t boot = boot_key();
  struct stat shm {
  }, net{};
  if (boot == 0 || ::stat("/dev/shm", &shm) != 0 || ::stat("/proc/self/ns/net", &net) != 0) {
    return {0, 0, 0, 0, 0};
  }
  return {1, boot, static_cast<int64_t>(shm.st_dev), static_cast<int64_t>(shm.st_ino),
          static_cast<int64_t>(net.st_ino)};
}

std::string outbox_name(int64_t nonce, int rank) {
  return "/ulysses-" + std::to_string(static_cast<uint64_t>(nonce)) + "-" + std::to_string(rank);
}

}  // namespace

SharedMemoryLinks::SharedMemoryLinks(const Group& group)
    : colocated_(group.size(), false), peers_(group.size()) {
  const int P = group.size(), me = group.rank();
  std::vector<int64_t> key = host_key();
  const auto nonce = static_cast<int64_t>(std::random_device{}() ^
                                          (static_cast<uint64_t>(std::random_device{}()) << 32));
  const std::string name = outbox_name(nonce, me);
  if (key[0] != 0) {
    mine_.fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (mine_.fd < 0) key[0] = 0;
  }
  key.push_back(nonce);
  const at::Tensor keys = group.all_gather(at::tensor(key, at::kLong));  // [P, 6]
  // Open the outbox of every peer with the same key; the link holds when both ends opened.
  std::vector<int64_t> opened(P, 0);
  for (int j = 0; j < P; ++j) {
    if (j == me || key[0] == 0 || !keys[j].narrow(0, 0, 5).equal(keys[me].narrow(0, 0, 5)))
      continue;
    const int fd = ::shm_open(outbox_name(keys[j][5].item<int64_t>(), j).c_str(), O_RDONLY, 0);
    if (fd < 0) continue;
    peers_[j].fd = fd;
    opened[j] = 1;
  }
  const at::Tensor all = group.all_gather(at::tensor(opened, at::kLong));  // [P, P]
  if (mine_.fd >= 0) ::shm_unlink(name.c_str());  // Every peer that could open it has.
  for (int j = 0; j < P; ++j) {
    colocated_[j] = all[me][j].item<int64_t>() != 0 && all[j][me].item<int64_t>() != 0;
    if (!colocated_[j] && peers_[j].fd >= 0) {
      ::close(peers_[j].fd);
      peers_[j].fd = -1;
    }
  }
}

SharedMemoryLinks::~SharedMemoryLinks() {
  auto release = [](Mapping& m) {
    if (m.p != nullptr) ::munmap(m.p, m.bytes);
    if (m.fd >= 0) ::close(m.fd);
  };
  release(mine_);
  for (Mapping& m : peers_) release(m);
}

int SharedMemoryLinks::map(Mapping& m, int64_t bytes, bool writable) {
  if (m.p != nullptr) ::munmap(m.p, m.bytes);
  m.p = nullptr;
  m.bytes = 0;
  void* p =
      ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, m.fd, 0);
  if (p == MAP_FAILED) return errno;
  m.p = p;
  m.bytes = bytes;
  return 0;
}

uint8_t* SharedMemoryLinks::outbox(int64_t bytes, int& error) {
  error = 0;
  if (bytes > mine_.bytes) {
    const int64_t rounded = (bytes + (int64_t{1} << 20) - 1) & ~((int64_t{1} << 20) - 1);
    if (::ftruncate(mine_.fd, rounded) != 0) {
      error = errno;
      return nullptr;
    }
    if (const int rc = ::posix_fallocate(mine_.fd, 0, rounded); rc != 0) {
      error = rc;
      return nullptr;
    }
    if ((error = map(mine_, rounded, true)) != 0) return nullptr;
  }
  return static_cast<uint8_t*>(mine_.p);
}

const uint8_t* SharedMemoryLinks::inbox(int peer, int64_t bytes, int& error) {
  Mapping& m = peers_[peer];
  error = bytes > m.bytes ? map(m, bytes, false) : 0;
  return error == 0 ? static_cast<const uint8_t*>(m.p) : nullptr;
}

}  // namespace ulysses::detail
