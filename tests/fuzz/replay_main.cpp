// A main for the fuzz targets where libFuzzer is not linked (the g++ build that CI runs):
// runs every seed in the given corpus directories, then a fixed number of deterministic
// mutations of them (byte flips, inserts, deletes, splices). scripts/fuzz.sh builds the same
// targets with clang's libFuzzer for coverage-guided runs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR... [-runs=N]\n", argv[0]);
    return 2;
  }
  long runs = 20000;
  std::vector<std::string> seeds;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("-runs=", 0) == 0) {
      runs = std::atol(a.c_str() + 6);
      continue;
    }
    for (const auto& f : std::filesystem::directory_iterator(a)) {
      std::ifstream in(f.path(), std::ios::binary);
      seeds.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }
  if (seeds.empty()) seeds.emplace_back();
  auto run = [](const std::string& s) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  };
  for (const auto& s : seeds) run(s);
  std::mt19937_64 rng(12345);
  auto below = [&](size_t n) { return n ? static_cast<size_t>(rng() % n) : 0; };
  for (long i = 0; i < runs; ++i) {
    std::string s = seeds[below(seeds.size())];
    for (int edits = 1 + static_cast<int>(below(4)); edits > 0; --edits) {
      switch (below(4)) {
        case 0:
          if (!s.empty()) s[below(s.size())] ^= static_cast<char>(1u << below(8));
          break;
        case 1:
          s.insert(s.begin() + below(s.size() + 1), static_cast<char>(rng()));
          break;
        case 2:
          if (!s.empty()) s.erase(below(s.size()), 1);
          break;
        default: {
          const std::string& other = seeds[below(seeds.size())];
          s = s.substr(0, below(s.size() + 1)) + other.substr(below(other.size() + 1));
        }
      }
    }
    run(s);
  }
  std::fprintf(stderr, "%zu seeds and %ld mutations: no invariant failed\n", seeds.size(), runs);
  return 0;
}
