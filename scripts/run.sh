#!/usr/bin/env bash
# The main job on its embedded default: builds, then runs it on local ranks (Gloo, loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
exec ./build/ulysses train --nproc 4 "$@"
