// How a command's failure reads: one line naming the command, exit 2 for a bad command line and
// 1 for any other failure. Shared by the command runner (program.cpp) and the planner's module,
// which loads no libtorch (c10 only).
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <iostream>
#include <string>

#include "args.h"

namespace ulysses::cli {

inline int report_failures(const std::string& name, const std::function<int()>& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::cerr << "ulysses " << name << ": " << e.what() << " (see 'ulysses " << name
              << " --help')\n";
    return 2;
  } catch (const c10::Error& e) {
    // Library messages start with their op ("train: ..."); do not say the command twice.
    std::string what = e.what_without_backtrace();
    const std::string op = name.substr(0, name.find(' ')) + ": ";
    if (what.rfind(op, 0) == 0) what.erase(0, op.size());
    std::cerr << "ulysses " << name << ": error: " << what << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ulysses " << name << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace ulysses::cli
