#!/usr/bin/env bash
# The test suite: unit tests, golden tests on the bundled tiny checkpoints, bad-input tests, and
# the real-weights test on EmbeddingGemma 300M. The real model is taken from $TERN_EGEMMA300M_DIR,
# else ~/.cache/tern/models/embeddinggemma-300m, fetched there first when the fetch tool is present.
set -euo pipefail
cd "$(dirname "$0")/.."
default_dir="$HOME/.cache/tern/models/embeddinggemma-300m"
if [ -z "${TERN_EGEMMA300M_DIR:-}" ]; then
  if [ ! -f "$default_dir/model.safetensors" ] && [ -x ../shared/tools/fetch-embeddinggemma-300m.sh ]; then
    echo "fetching EmbeddingGemma 300M for the real-weights test" >&2
    bash ../shared/tools/fetch-embeddinggemma-300m.sh >/dev/null
  fi
  export TERN_EGEMMA300M_DIR="$default_dir"
fi
cargo test --release "$@"
