// The local launcher: starts N local ranks of a command, like torchrun on one machine
// (`ulysses launch`, and the subcommands that relaunch themselves with --nproc N).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "args.h"
#include "program.h"

namespace ulysses::cli {
namespace {

// `addr` must be a numeric IPv4/IPv6 address, or a host name this machine resolves: checked
// before any rank starts, so a typo is one line and exit 2, not c10d's retries for seconds.
void check_address(const std::string& addr) {
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST;
  addrinfo* found = nullptr;
  if (::getaddrinfo(addr.c_str(), nullptr, &hints, &found) == 0) {
    ::freeaddrinfo(found);
    return;
  }
  const bool name_like =
      !addr.empty() && addr.size() <= 253 && std::all_of(addr.begin(), addr.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.';
      });
  hints.ai_flags = 0;
  if (name_like && ::getaddrinfo(addr.c_str(), nullptr, &hints, &found) == 0) {
    ::freeaddrinfo(found);
    return;
  }
  throw UsageError("option --addr must be an IP address or a host name that resolves here; got '" +
                   addr + "'");
}

// Asks the kernel for a free loopback port.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("launch: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("launch: could not find a free port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

// One started rank and the unfinished tail of its two output streams.
struct Child {
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;
  std::string out_tail, err_tail;
  std::vector<std::string> held_err;  // Ranks > 0: stderr lines, printed at the end if unique.
  bool running = true;
};

// How long ranks get to exit by themselves after another rank failed: ranks that fail together
// (an agreed error) all print their message and exit within it, so none of it is lost.
constexpr auto kGrace = std::chrono::seconds(3);

volatile sig_atomic_t g_interrupted = 0;  // Set by SIGINT/SIGTERM; read by the event loop.
void on_signal(int) { g_interrupted = 1; }

// Passes every complete line of `buf` to `emit`, keeping the incomplete tail (all of it when
// `flush_all`).
template <typename Emit>
void take_lines(std::string& buf, bool flush_all, Emit&& emit) {
  size_t start = 0, nl;
  while ((nl = buf.find('\n', start)) != std::string::npos) {
    emit(buf.substr(start, nl - start));
    start = nl + 1;
  }
  buf.erase(0, start);
  if (flush_all && !buf.empty()) {
    emit(buf);
    buf.clear();
  }
}

// Starts rank `r` of `nproc` running `command`, its stdout and stderr piped to us.
Child start_rank(int r, const LaunchOptions& options, int port, const Argv& command) {
  int out[2], err[2];
  if (::pipe(out) != 0 || ::pipe(err) != 0) throw std::runtime_error("launch: pipe() failed");
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("launch: fork() failed");
  if (pid == 0) {
    // A rank dies with its launcher, however the launcher ends (SIGKILL included): no orphan
    // keeps training. (A launcher gone before this line is caught by the parent check.)
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher) ::_exit(1);
    ::setpgid(0, 0);  // Its own process group, so stopping a rank stops what it started.
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::close(out[0]), ::close(out[1]), ::close(err[0]), ::close(err[1]);
    ::setenv("RANK", std::to_string(r).c_str(), 1);
    ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
    ::setenv("LOCAL_WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
    ::setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    std::vector<char*> cargv;
    for (const auto& a : command) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);
    ::execvp(cargv[0], cargv.data());
    std::fprintf(stderr, "launch: cannot run '%s': %s\n", cargv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out[1]), ::close(err[1]);
  return Child{pid, out[0], err[0]};
}

// The running ranks of one launch: their output, their exits, and stopping them.
class Ranks {
 public:
  explicit Ranks(std::vector<Child> children)
      : children_(std::move(children)), running_(static_cast<int>(children_.size())) {}

  bool active() const {
    return running_ > 0 || std::any_of(children_.begin(), children_.end(), [](const Child& c) {
             return c.out_fd >= 0 || c.err_fd >= 0;
           });
  }

  // Waits up to 100 ms for output and forwards what came, line by line. Note [One copy of a
  // shared error]: rank 0's stderr is shown as it comes; other ranks' stderr is held and shown
  // at the end only where it differs from rank 0's, so an error every rank raised alike is
  // printed once, as rank 0's.
  void pump_output() {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owner;  // (rank, is_stderr) per pollfd.
    for (int r = 0; r < size(); ++r) {
      if (children_[r].out_fd >= 0)
        fds.push_back({children_[r].out_fd, POLLIN, 0}), owner.push_back({r, false});
      if (children_[r].err_fd >= 0)
        fds.push_back({children_[r].err_fd, POLLIN, 0}), owner.push_back({r, true});
    }
    if (fds.empty()) {
      ::usleep(20000);
      return;
    }
    ::poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const int rank = owner[i].first;
      const bool is_err = owner[i].second;
      Child& c = children_[rank];
      char buf[65536];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      std::string& tail = is_err ? c.err_tail : c.out_tail;
      if (n > 0) tail.append(buf, n);
      take_lines(tail, n <= 0, [&](const std::string& line) {
        if (is_err && rank > 0) {
          c.held_err.push_back(line);
        } else {
          (is_err ? std::cerr : std::cout) << "[rank " << rank << "] " << line << "\n";
          if (is_err) rank0_err_.insert(line);
        }
      });
      (is_err ? std::cerr : std::cout).flush();
      if (n <= 0) {
        ::close(fds[i].fd);
        (is_err ? c.err_fd : c.out_fd) = -1;
      }
    }
  }

  // Reaps ranks that exited; returns the exit code of the first that failed (0 if none).
  int reap(bool quiet) {
    int failed = 0;
    for (int r = 0; r < size(); ++r) {
      Child& c = children_[r];
      int status = 0;
      if (!c.running || ::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
      c.running = false;
      --running_;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && failed == 0 && !quiet) {
        failed = code;
        std::cerr << "[launch] rank " << r << " exited with code " << code
                  << (running_ > 0 ? "; stopping the other ranks" : "") << "\n";
      }
    }
    return failed;
  }

  int running() const { return running_; }

  void signal_all(int sig) {
    for (Child& c : children_)
      if (c.running) ::kill(-c.pid, sig);
  }

  // Other ranks' stderr, where it differs from rank 0's (Note [One copy of a shared error]).
  void print_held_stderr() const {
    std::vector<int> alike;
    for (int r = 1; r < size(); ++r) {
      std::multiset<std::string> shown = rank0_err_;
      bool repeated = false;
      for (const std::string& line : children_[r].held_err) {
        auto it = shown.find(line);
        if (it != shown.end()) {
          shown.erase(it);
          repeated = true;
        } else {
          std::cerr << "[rank " << r << "] " << line << "\n";
        }
      }
      if (repeated) alike.push_back(r);
    }
    if (alike.empty()) return;
    std::cerr << "[launch] rank";
    if (alike.size() > 1) std::cerr << "s";
    for (size_t i = 0; i < alike.size(); ++i) std::cerr << (i ? ", " : " ") << alike[i];
    std::cerr << " printed the same as rank 0 (shown once)\n";
  }

 private:
  int size() const { return static_cast<int>(children_.size()); }
  std::vector<Child> children_;
  int running_;
  std::multiset<std::string> rank0_err_;  // Rank 0's stderr lines so far.
};

}  // namespace

int launch(const LaunchOptions& options, const Argv& command) {
  if (options.nproc < 1) throw UsageError("-n must be >= 1");
  if (command.empty()) throw UsageError("no command given after --");
  const int port = options.master_port ? options.master_port : free_port();
  ::signal(SIGINT, on_signal);
  ::signal(SIGTERM, on_signal);
  ::signal(SIGPIPE, SIG_IGN);
  std::vector<Child> children;
  for (int r = 0; r < options.nproc; ++r) children.push_back(start_rank(r, options, port, command));
  Ranks ranks(std::move(children));

  // After the first failure the others get kGrace to exit by themselves, then SIGTERM, then
  // (5 s later) SIGKILL.
  using Clock = std::chrono::steady_clock;
  int first_failure = 0;
  bool stopping = false;
  Clock::time_point failed_at, stop_started;
  while (ranks.active()) {
    ranks.pump_output();
    const int failed = ranks.reap(first_failure != 0 || stopping);
    const auto now = Clock::now();
    if (failed != 0) first_failure = failed, failed_at = now;
    const bool grace_over = first_failure != 0 && now - failed_at > kGrace;
    if ((grace_over || g_interrupted) && !stopping && ranks.running() > 0) {
      stopping = true;
      stop_started = now;
      if (first_failure == 0) first_failure = 130;
      ranks.signal_all(SIGTERM);
      ranks.signal_all(SIGCONT);  // A frozen (stopped) rank takes its SIGTERM now, not at SIGKILL.
    }
    if (stopping && ranks.running() > 0 && now - stop_started > std::chrono::seconds(5)) {
      ranks.signal_all(SIGKILL);
    }
  }
  ranks.print_held_stderr();
  return first_failure;
}

int ranks_to_run(int nproc) {
  const char* world = std::getenv("WORLD_SIZE");
  return std::getenv("RANK") != nullptr && world != nullptr ? std::atoi(world) : nproc;
}

int relaunch_as_ranks(int nproc, const Argv& self, const Argv& subcommand, const Argv& args) {
  if (std::getenv("RANK") != nullptr || nproc <= 1) return -1;
  Argv command = self;
  command.insert(command.end(), subcommand.begin(), subcommand.end());
  command.insert(command.end(), args.begin(), args.end());
  LaunchOptions options;
  options.nproc = nproc;
  return launch(options, command);
}

const Options& launch_options() {
  static const Options options{required("-n", "N").in(1, kMaxRanks),
                               value("--port", "0").in(0, 65535), value("--addr", "127.0.0.1")};
  return options;
}

int launch_main(const Argv& args) {
  auto sep = std::find(args.begin(), args.end(), std::string("--"));
  Argv before(args.begin(), sep);
  for (auto& a : before)
    if (a == "--nproc") a = "-n";  // Both spellings; messages use -n, launch's own flag.
  const Args parsed(before, launch_options());
  LaunchOptions options;
  if (!parsed.has("-n")) throw UsageError("-n N (the number of ranks) is required");
  options.nproc = static_cast<int>(parsed.integer("-n"));
  options.master_port = static_cast<int>(parsed.integer("--port"));
  options.master_addr = parsed.str("--addr");
  check_address(options.master_addr);
  if (sep == args.end()) throw UsageError("expected -- <command> after the options");
  return launch(options, Argv(sep + 1, args.end()));
}

}  // namespace ulysses::cli
