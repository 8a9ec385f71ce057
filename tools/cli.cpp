// The subcommands of tools/: their usage and entry points.
#include "commands.h"

namespace ulysses::cli {

std::vector<Command> cli_commands() {
  return {
      {"train",
       "[--nproc 4] [--sp P] [--dp D] [--ring R] [--seq-len 256] [--batch 8] [--steps 400]\n"
       "        [--dim 128] [--layers 2] [--q-heads 8] [--kv-heads 2] [--ffn-dim 0] [--lr 5e-3]\n"
       "        [--warmup 50] [--lr-decay-steps STEPS] [--weight-decay 0.01] [--clip 1.0]\n"
       "        [--pairs 16] [--shuffle] [--data FILE] [--eval-every 100] [--eval-sequences 64]\n"
       "        [--log-every 25] [--seed 0] [--check] [--save DIR] [--resume DIR] [--timeout 120]\n"
       "        [--pipeline-min-kib 4096] [--message-kib 4096]",
       "sequence-parallel training of a GQA transformer on local ranks (or under torchrun)",
       train_main},
      {"plan",
       "--q-heads N [--kv-heads N] --sp P [--seq-len S] [--head-dim 128] [--batch 1]\n"
       "        [--elem-bytes 2] [--json]",
       "print the head (and sequence) partition of every rank and the recommended\n"
       "        Ulysses x ring split with its memory and bytes moved per layer",
       without_runtime(plan_main)},
      {"demo",
       "[--nproc 4] [--q-heads 8] [--kv-heads 2] [--seq-len 1024] [--head-dim 64]\n"
       "        [--timeout 120] [--pipeline-min-kib 4096] [--message-kib 4096]",
       "checked all-to-all round trip of a GQA layout on local ranks", demo_main},
      {"launch", "-n N [--port 0] [--addr 127.0.0.1] -- <command> [args...]",
       "run <command> as N local ranks (torchrun's environment, Gloo on loopback)",
       without_runtime(launch_main)},
  };
}

}  // namespace ulysses::cli
