#include "reference_a2a.h"

#include <vector>

namespace ulysses::bench {
namespace {

// Rank r's share of n items: n/P + (r < n%P), as the reference's get_shard_size_list.
std::vector<int64_t> shard_sizes(int64_t n, int P) {
  std::vector<int64_t> out;
  for (int r = 0; r < P; ++r) out.push_back(n / P + (r < n % P ? 1 : 0));
  return out;
}

at::Tensor a2a(const at::Tensor& in, at::Tensor out, const std::vector<int64_t>& out_splits,
               const std::vector<int64_t>& in_splits, const Group& g, int64_t row) {
  // all_to_all_single splits dim 0; our Group takes flat element counts.
  std::vector<int64_t> o, i;
  for (int64_t s : out_splits) o.push_back(s * row);
  for (int64_t s : in_splits) i.push_back(s * row);
  at::Tensor flat_in = in.view({-1}), flat_out = out.view({-1});
  g.all_to_all(flat_out, flat_in, o, i);
  return out;
}

}  // namespace

at::Tensor reference_scatter_heads(const at::Tensor& x, const Group& g) {
  const int P = g.size();
  const int64_t b = x.size(0), s = x.size(1), H = x.size(2), D = x.size(3);
  if (H % P == 0) {
    at::Tensor t = x.reshape({b, s, P, H / P, D}).contiguous();
    t = t.permute({2, 0, 1, 3, 4}).contiguous();
    at::Tensor out = at::empty_like(t);
    a2a(t, out, std::vector<int64_t>(P, 1), std::vector<int64_t>(P, 1), g, t.numel() / P);
    out = out.permute({1, 0, 2, 3, 4}).contiguous();
    return out.reshape({b, P * s, H / P, D}).contiguous();
  }
  // Uneven heads: heads first, uneven input splits.
  const auto splits = shard_sizes(H, P);
  at::Tensor t = x.transpose(0, 2).contiguous();  // [H, s, b, D]
  const int64_t local = splits[g.rank()];
  at::Tensor out = at::empty({P * local, s, b, D}, x.options());
  a2a(t, out, std::vector<int64_t>(P, local), splits, g, s * b * D);
  out = out.view({P, local, s, b, D});
  out = out.permute({3, 0, 2, 1, 4}).contiguous();  // [b, P, s, local, D]
  return out.view({b, P * s, local, D}).contiguous();
}

at::Tensor reference_gather_heads(const at::Tensor& y, int64_t H, const Group& g) {
  const int P = g.size();
  const int64_t b = y.size(0), S = y.size(1), local = y.size(2), D = y.size(3);
  const int64_t s = S / P;
  if (H % P == 0) {
    at::Tensor t = y.reshape({b, P, s, local, D}).contiguous();
    t = t.permute({1, 0, 2, 3, 4}).contiguous();
    at::Tensor out = at::empty_like(t);
    a2a(t, out, std::vector<int64_t>(P, 1), std::vector<int64_t>(P, 1), g, t.numel() / P);
    out = out.permute({1, 2, 0, 3, 4}).contiguous();  // [b, s, P, local, D]
    return out.reshape({b, s, H, D}).contiguous();
  }
  // Uneven heads: flatten to [S, local*D, b], even splits over the sequence.
  at::Tensor t = y.reshape({b, S, -1}).permute({1, 2, 0}).contiguous();  // [S, h, b]
  t = t.view({S * local * D, b});
  const auto heads = shard_sizes(H, P);
  const int64_t per_head = s * D;  // Rows of one head of one rank's tokens.
  std::vector<int64_t> out_splits;
  for (int64_t h : heads) out_splits.push_back(h * per_head);
  at::Tensor out = at::empty({H * per_head, b}, y.options());
  a2a(t, out, out_splits, std::vector<int64_t>(P, s * local * D), g, b);
  const int64_t small = H / P, large = small + 1, n_large = H % P, n_small = P - n_large;
  auto parts = out.split({per_head * n_large * large, per_head * n_small * small}, 0);
  at::Tensor big = parts[0]
                       .view({n_large, s, large, D, b})
                       .permute({4, 1, 0, 2, 3})
                       .contiguous()
                       .view({b, s, n_large * large, D});
  at::Tensor little = parts[1]
                          .view({n_small, s, small, D, b})
                          .permute({4, 1, 0, 2, 3})
                          .contiguous()
                          .view({b, s, n_small * small, D});
  return at::cat({big, little}, 2).contiguous().view({b, s, H, D});
}

}  // namespace ulysses::bench
