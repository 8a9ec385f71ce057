#include "transport/environment.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace ulysses {

bool shared_memory_from_environment() {
  const char* v = std::getenv("ULYSSES_SHARED_MEMORY");
  return v == nullptr || std::string(v) != "0";
}

std::optional<GroupOptions::Transport> transport_from_environment() {
  const char* v = std::getenv("ULYSSES_TRANSPORT");
  if (v == nullptr || *v == 0) return std::nullopt;
  try {
    return parse_transport(v);
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, "ULYSSES_TRANSPORT: ", e.what_without_backtrace());
  }
}

std::optional<bool> overlap_chunks_from_environment() {
  const char* v = std::getenv("ULYSSES_OVERLAP_CHUNKS");
  const std::string word = v == nullptr ? "" : v;
  if (word.empty() || word == "auto") return std::nullopt;
  TORCH_CHECK_VALUE(word == "0" || word == "1",
                    "ULYSSES_OVERLAP_CHUNKS: expected 1, 0 or auto; got '", word, "'");
  return word == "1";
}

}  // namespace ulysses
