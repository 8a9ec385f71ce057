// `ulysses bench gemm`: the GEMM the attention kernel calls (the BLAS `sgemm_` exported by
// libtorch_cpu, i.e. the MKL inside the PyTorch wheel) against torch.matmul (at::mm) on the
// same shapes, the kernel's tile shapes included.
#include <ATen/Parallel.h>

#include <iostream>

#include "args.h"
#include "bench.h"
#include "bench_util.h"

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c, const int* ldc);

namespace ulysses::cli {

const Options& bench_gemm_options() {
  // M x N x K triples: the kernel's tiles (s = q k^T: 64 x 128 x 64; o += p v: 64 x 64 x 128)
  // and a large square product.
  static const Options options{
      choice("--shapes", "M,N,K,...", "64,128,64,64,64,128,1024,1024,1024").each_in(1, 1 << 20),
      value("--threads", "1").in(1, 1024), value("--repeats", "20").in(1, 100000)};
  return options;
}

int bench_gemm_main(const Argv& argv) {
  const Args args(argv, bench_gemm_options());
  const auto dims = args.integers("--shapes");
  const int threads = static_cast<int>(args.integer("--threads"));
  const int repeats = static_cast<int>(args.integer("--repeats"));
  if (dims.size() % 3 != 0) throw UsageError("option --shapes takes M,N,K triples");
  at::set_num_threads(threads);
  std::cout << "kernel GEMM: sgemm_ from " << bench::gemm_library() << "; " << threads
            << " thread(s)\n";
  std::vector<bench::Record> records;
  for (size_t i = 0; i < dims.size(); i += 3) {
    const int m = static_cast<int>(dims[i]), n = static_cast<int>(dims[i + 1]),
              k = static_cast<int>(dims[i + 2]);
    at::Tensor a = at::randn({m, k}), b = at::randn({k, n}), c = at::empty({m, n});
    // Row-major C = A B is column-major C^T = B^T A^T: the kernel's own call pattern.
    const float one = 1.0f, zero = 0.0f;
    auto kernel = bench::time_ms(
        [&] {
          sgemm_("N", "N", &n, &m, &k, &one, b.data_ptr<float>(), &n, a.data_ptr<float>(), &k,
                 &zero, c.data_ptr<float>(), &n);
        },
        3, repeats);
    at::Tensor expect = at::mm(a, b);
    TORCH_CHECK(at::allclose(c, expect, 1e-4, 1e-4),
                "bench gemm: sgemm_ result differs from at::mm");
    auto torch_mm = bench::time_ms([&] { at::mm_out(c, a, b); }, 3, repeats);
    const double flop = 2.0 * m * n * k;
    bench::Record r;
    r.add("shape", std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k))
        .add("kernel_gemm_gflops", flop / (kernel.median * 1e6))
        .add("matmul_gflops", flop / (torch_mm.median * 1e6))
        .add("kernel_over_matmul", torch_mm.median / kernel.median);
    records.push_back(r);
  }
  bench::print_table(records,
                     {"shape", "kernel_gemm_gflops", "matmul_gflops", "kernel_over_matmul"});
  return 0;
}

}  // namespace ulysses::cli
