#!/usr/bin/env bash
# The test suite: unit tests, golden tests on the bundled tiny checkpoints, bad-input tests, the
# real-weights test on EmbeddingGemma 300M and the HTTP server test with the openai client. The
# real model is taken from $TERN_EGEMMA300M_DIR, else ~/.cache/tern/models/embeddinggemma-300m,
# fetched there first when the fetch tool is present.
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
# The server test drives `tern serve` with the official `openai` Python client, pinned.
if [ -z "${TERN_CLIENT_PYTHON:-}" ]; then
  client_env="$HOME/.cache/tern/clientenv"
  if ! "$client_env/bin/python" -c 'import openai, sys; sys.exit(openai.__version__ != "3.57.0")' 2>/dev/null; then
    echo "installing the openai client for the server test" >&2
    python3 -m venv "$client_env"
    "$client_env/bin/pip" install -q "openai==3.57.0"
  fi
  export TERN_CLIENT_PYTHON="$client_env/bin/python"
fi
cargo test --release "$@"
