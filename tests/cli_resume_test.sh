#!/usr/bin/env bash
# `ulysses train --save/--resume`: a run resumed from a checkpoint at step 3 prints the same
# losses for steps 4-6 as the uninterrupted run.
set -euo pipefail
ulysses="$1"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(--nproc 2 --seq-len 48 --pairs 4 --batch 2 --eval-every 0 --lr 1e-2)
"$ulysses" train "${common[@]}" --steps 6 | grep -o 'step [0-9]*/6 loss [0-9.]*' >"$dir/full"
"$ulysses" train "${common[@]}" --steps 3 --save "$dir/ckpt" >/dev/null
"$ulysses" train "${common[@]}" --steps 6 --resume "$dir/ckpt" | grep -o 'step [0-9]*/6 loss [0-9.]*' >"$dir/resumed"
tail -n 3 "$dir/full" >"$dir/expected"
echo "uninterrupted:"; cat "$dir/expected"; echo "resumed:"; cat "$dir/resumed"
[ "$(wc -l <"$dir/resumed")" -eq 3 ] && diff "$dir/expected" "$dir/resumed" && echo "resume OK"
