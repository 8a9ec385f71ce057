#!/usr/bin/env bash
# The main job: builds, then runs `ulysses train` on 4 local ranks (Gloo on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec .venv/bin/ulysses train --nproc 4 "$@"
