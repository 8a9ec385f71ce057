#include "program.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <iostream>

#include "report.h"

namespace ulysses::cli {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// Prints the usage of every command whose name starts with `prefix` ("" for all).
void print_usage(std::ostream& os, const std::vector<Command>& commands,
                 const std::string& prefix) {
  if (prefix.empty()) {
    os << "usage: ulysses <command> [options]    (ulysses <command> --help, ulysses --version)\n\n"
          "commands (--timeout SECONDS bounds every collective of those that communicate;\n"
          "--pipeline-min-kib K and --message-kib M: CPU all-to-alls sending >= K KiB per rank\n"
          "go as pipelined messages of M KiB; defaults 4096 and 4096; their blocks for ranks on\n"
          "this host go through /dev/shm unless --no-shared-memory (or ULYSSES_SHARED_MEMORY=0);\n"
          "--transport batched posts each step's point-to-point transfers together, the way\n"
          "NCCL needs them, as ULYSSES_TRANSPORT=batched does; auto picks per backend):\n";
  }
  for (const Command& c : commands) {
    if (!starts_with(c.name, prefix)) continue;
    const std::string lead =
        (prefix.empty() ? "  " : "usage: ") + std::string("ulysses ") + c.name + " ";
    os << lead << synopsis(c.options, c.tail, lead.size()) << "\n"
       << (prefix.empty() ? "    " : "") << c.about << "\n";
  }
}

bool asks_for_help(const Argv& args) {
  for (const std::string& a : args) {
    if (a == "--") return false;  // What follows belongs to launch's command.
    if (a == "--help" || a == "-h") return true;
  }
  return false;
}

// The command `argv` names: a one-word command ("train") or a group and its member ("bench
// a2a"); nullptr when none. `typed`: the name as the user typed it, for messages.
const Command* find_command(const Argv& argv, const std::vector<Command>& commands,
                            std::string& typed) {
  typed = argv[0];
  if (argv.size() > 1 && !starts_with(argv[1], "-")) typed += " " + argv[1];
  for (const Command& c : commands) {
    if (c.name == argv[0] || c.name == typed) {
      typed = c.name;
      return &c;
    }
  }
  return nullptr;
}

// The members of group `group` ("bench": "attention, a2a, layer or gemm"); "" if none.
std::string members_of(const std::vector<Command>& commands, const std::string& group) {
  std::vector<std::string> names;
  for (const Command& c : commands)
    if (starts_with(c.name, group + " ")) names.push_back(c.name.substr(group.size() + 1));
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return out;
}

}  // namespace

constexpr int64_t kKiB = 1024;
constexpr int64_t kMostKiB = int64_t{1} << 40;

Options group_option_table() {
  const GroupOptions defaults;
  return {value("--timeout", "120").in(1, 86400),
          value("--pipeline-min-kib", std::to_string(defaults.pipeline_min_bytes / kKiB))
              .in(0, kMostKiB),
          value("--message-kib", std::to_string(defaults.message_bytes / kKiB)).in(1, kMostKiB),
          flag("--shared-memory"),
          flag("--no-shared-memory"),
          placeholder("--transport", "auto|messages|batched")};
}

GroupOptions group_options(const Args& args) {
  GroupOptions options;
  options.timeout = std::chrono::seconds(args.integer("--timeout"));
  options.pipeline_min_bytes = kKiB * args.integer("--pipeline-min-kib");
  options.message_bytes = kKiB * args.integer("--message-kib");
  if (args.has("--shared-memory") && args.has("--no-shared-memory"))
    throw UsageError("options --shared-memory and --no-shared-memory exclude each other");
  if (args.has("--shared-memory")) options.shared_memory = true;  // Else the environment's.
  if (args.has("--no-shared-memory")) options.shared_memory = false;
  if (args.has("--transport")) {
    const std::string transport = args.str("--transport");
    try {
      options.transport = parse_transport(transport);
    } catch (const c10::ValueError&) {
      throw UsageError("option --transport must be auto, messages or batched; got '" +
                       shown(transport) + "'");
    }
  }
  return options;
}

int run_program(const Argv& argv, const std::vector<Command>& commands, const Runtime& runtime,
                const std::string& version) {
  if (argv.empty() || argv[0] == "--help" || argv[0] == "-h") {
    print_usage(argv.empty() ? std::cerr : std::cout, commands, "");
    return argv.empty() ? 2 : 0;
  }
  if (argv[0] == "--version") {
    std::cout << "ulysses " << version << " (torch " << TORCH_VERSION << ")\n";
    return 0;
  }
  std::string name;
  const Command* command = find_command(argv, commands, name);
  const std::string members = members_of(commands, argv[0]);
  if (command == nullptr && members.empty()) {
    std::cerr << "ulysses: unknown command '" << shown(argv[0]) << "' (see 'ulysses --help')\n";
    return 2;
  }
  if (command == nullptr) name = argv[0];  // A group ("bench") without a known member.
  const size_t words =
      command ? static_cast<size_t>(std::count(name.begin(), name.end(), ' ')) + 1 : 1;
  const Argv args(argv.begin() + static_cast<std::ptrdiff_t>(std::min(words, argv.size())),
                  argv.end());
  if (asks_for_help(args)) {
    print_usage(std::cout, commands, name);
    return 0;
  }
  return report_failures(name, [&] {
    if (command == nullptr) {
      if (args.empty() || starts_with(args[0], "-"))
        throw UsageError("say which " + name + ": " + members);
      throw UsageError("unknown " + name + " '" + shown(args[0]) + "'; choose " + members);
    }
    return command->run(args, runtime);
  });
}

}  // namespace ulysses::cli
