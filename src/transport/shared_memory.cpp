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
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  control_bytes_ = (kFields * int64_t{8} + page - 1) / page * page;
  std::vector<int64_t> key = host_key();
  const auto nonce = static_cast<int64_t>(std::random_device{}() ^
                                          (static_cast<uint64_t>(std::random_device{}()) << 32));
  const std::string name = outbox_name(nonce, me);
  if (key[0] != 0) {
    mine_.fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    // The control page exists (zeros: no exchange yet) before any peer can open the outbox.
    if (mine_.fd < 0 || ::ftruncate(mine_.fd, control_bytes_) != 0 ||
        ::posix_fallocate(mine_.fd, 0, control_bytes_) != 0 ||
        map(mine_, control_bytes_, true) != 0) {
      key[0] = 0;
    }
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
    opened[j] = map(peers_[j], control_bytes_, false) == 0 ? 1 : 0;
  }
  const at::Tensor all = group.all_gather(at::tensor(opened, at::kLong)).contiguous();  // [P, P]
  if (mine_.fd >= 0) ::shm_unlink(name.c_str());  // Every peer that could open it has.
  const int64_t* linked = all.data_ptr<int64_t>();
  all_linked_ = P > 1;
  for (int i = 0; i < P; ++i) {
    for (int j = 0; j < P; ++j) {
      if (i != j && (linked[i * P + j] == 0 || linked[j * P + i] == 0)) all_linked_ = false;
    }
  }
  for (int j = 0; j < P; ++j) {
    colocated_[j] = linked[me * P + j] != 0 && linked[j * P + me] != 0;
    if (!colocated_[j] && peers_[j].fd >= 0) {
      if (peers_[j].p != nullptr) ::munmap(peers_[j].p, peers_[j].bytes);
      peers_[j].p = nullptr;
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
  // The new mapping first: on failure the old one (its control page) stays readable.
  void* p =
      ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, m.fd, 0);
  if (p == MAP_FAILED) return errno;
  if (m.p != nullptr) ::munmap(m.p, m.bytes);
  m.p = p;
  m.bytes = bytes;
  return 0;
}

uint8_t* SharedMemoryLinks::outbox(int64_t bytes, int& error) {
  error = 0;
  if (control_bytes_ + bytes > mine_.bytes) {
    const int64_t rounded =
        control_bytes_ + ((bytes + (int64_t{1} << 20) - 1) & ~((int64_t{1} << 20) - 1));
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
  return static_cast<uint8_t*>(mine_.p) + control_bytes_;
}

const uint8_t* SharedMemoryLinks::inbox(int peer, int64_t bytes, int& error) {
  Mapping& m = peers_[peer];
  error = control_bytes_ + bytes > m.bytes ? map(m, control_bytes_ + bytes, false) : 0;
  return error == 0 ? static_cast<const uint8_t*>(m.p) + control_bytes_ : nullptr;
}

void SharedMemoryLinks::publish(int f, int64_t value) {
  int64_t* p = field(mine_, f);
  if (f == kPacked || f == kRead) {
    __atomic_store_n(p, value, __ATOMIC_RELEASE);
  } else {
    __atomic_store_n(p, value, __ATOMIC_RELAXED);
  }
}

int64_t SharedMemoryLinks::peer_field(int peer, int f) const {
  const int64_t* p = static_cast<const int64_t*>(peers_[peer].p) + f;
  return __atomic_load_n(p, f == kPacked || f == kRead ? __ATOMIC_ACQUIRE : __ATOMIC_RELAXED);
}

}  // namespace ulysses::detail
