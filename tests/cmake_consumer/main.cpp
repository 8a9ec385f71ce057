// Uses the installed library with a group of one rank: plan, scatter, local attention, gather.
#include <ulysses/all_to_all.h>
#include <ulysses/distributed_attention.h>

#include <iostream>

int main() {
  using namespace ulysses;
  auto heads = HeadPartition::make(6, 3, 2);
  std::cout << heads << "\n";
  DistributedAttention attention(Group::solo());
  at::Tensor q = at::randn({1, 8, 4, 16}), k = at::randn({1, 8, 2, 16});
  at::Tensor o = attention(q, k, k);
  std::cout << "output " << o.sizes() << "\n";
  return o.sizes() == q.sizes() ? 0 : 1;
}
