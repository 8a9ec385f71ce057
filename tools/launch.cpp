// `ulysses launch`: starts N local ranks of a command, like torchrun on one machine.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "args.h"
#include "commands.h"

namespace ulysses::cli {
namespace {

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
  bool running = true;
};

volatile sig_atomic_t g_interrupted = 0;  // Set by SIGINT/SIGTERM; read by the event loop.
void on_signal(int) { g_interrupted = 1; }

// Writes every complete line of `buf` with `prefix`, keeping the incomplete tail.
void emit_lines(std::string& buf, const std::string& prefix, std::ostream& os, bool flush_all) {
  size_t start = 0, nl;
  while ((nl = buf.find('\n', start)) != std::string::npos) {
    os << prefix << buf.substr(start, nl - start + 1);
    start = nl + 1;
  }
  buf.erase(0, start);
  if (flush_all && !buf.empty()) {
    os << prefix << buf << "\n";
    buf.clear();
  }
  os.flush();
}

}  // namespace

int launch(const LaunchOptions& options, const Argv& command) {
  if (options.nproc < 1) throw UsageError("launch: -n must be >= 1");
  if (command.empty()) throw UsageError("launch: no command given after --");
  const int port = options.master_port ? options.master_port : free_port();
  ::signal(SIGINT, on_signal);
  ::signal(SIGTERM, on_signal);
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<Child> children(options.nproc);
  for (int r = 0; r < options.nproc; ++r) {
    int out[2], err[2];
    if (::pipe(out) != 0 || ::pipe(err) != 0) throw std::runtime_error("launch: pipe() failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("launch: fork() failed");
    if (pid == 0) {
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
    children[r] = Child{pid, out[0], err[0]};
  }

  int first_failure = 0;
  int running = options.nproc;
  bool stopping = false;
  auto stop_started = std::chrono::steady_clock::now();
  auto stop_all = [&](int sig) {
    for (Child& c : children)
      if (c.running) ::kill(-c.pid, sig);
  };
  while (running > 0 || std::any_of(children.begin(), children.end(), [](const Child& c) {
           return c.out_fd >= 0 || c.err_fd >= 0;
         })) {
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> owner;  // (rank, is_stderr) per pollfd.
    for (int r = 0; r < options.nproc; ++r) {
      if (children[r].out_fd >= 0) fds.push_back({children[r].out_fd, POLLIN, 0}), owner.push_back({r, false});
      if (children[r].err_fd >= 0) fds.push_back({children[r].err_fd, POLLIN, 0}), owner.push_back({r, true});
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Child& c = children[owner[i].first];
      const bool is_err = owner[i].second;
      char buf[65536];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      std::string& tail = is_err ? c.err_tail : c.out_tail;
      const std::string prefix = "[rank " + std::to_string(owner[i].first) + "] ";
      std::ostream& os = is_err ? std::cerr : std::cout;
      if (n > 0) {
        tail.append(buf, n);
        emit_lines(tail, prefix, os, false);
      } else {
        emit_lines(tail, prefix, os, true);
        ::close(fds[i].fd);
        (is_err ? c.err_fd : c.out_fd) = -1;
      }
    }
    for (int r = 0; r < options.nproc; ++r) {
      Child& c = children[r];
      int status = 0;
      if (!c.running || ::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
      c.running = false;
      --running;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && first_failure == 0 && !stopping) {
        first_failure = code;
        std::cerr << "[launch] rank " << r << " exited with code " << code
                  << "; stopping the other ranks\n";
      }
    }
    if ((first_failure != 0 || g_interrupted) && !stopping && running > 0) {
      stopping = true;
      stop_started = std::chrono::steady_clock::now();
      if (first_failure == 0) first_failure = 130;
      stop_all(SIGTERM);
    }
    if (stopping && running > 0 &&
        std::chrono::steady_clock::now() - stop_started > std::chrono::seconds(5)) {
      stop_all(SIGKILL);
    }
    if (fds.empty() && running > 0) ::usleep(20000);
  }
  return first_failure;
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

int launch_main(const Argv& args) {
  auto sep = std::find(args.begin(), args.end(), std::string("--"));
  Argv before(args.begin(), sep);
  for (auto& a : before)
    if (a == "-n") a = "--nproc";
  Args parsed(before, {});
  LaunchOptions options;
  options.nproc = static_cast<int>(parsed.required_integer("--nproc"));
  options.master_port = static_cast<int>(parsed.integer("--port", 0));
  options.master_addr = parsed.str("--addr", "127.0.0.1");
  parsed.finish();
  if (sep == args.end()) throw UsageError("launch: expected -- <command>");
  return launch(options, Argv(sep + 1, args.end()));
}

}  // namespace ulysses::cli
