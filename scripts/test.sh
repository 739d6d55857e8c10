#!/usr/bin/env bash
# The test suite: unit tests, golden tests on the bundled tiny checkpoints, bad-input tests, the
# real-weights test on EmbeddingGemma 300M, the HTTP server test with the openai client, the
# CUDA compile check, and the CUDA device tests on hostcuda (scripts/test-hostcuda.sh). The real
# model is taken from $TERN_EGEMMA300M_DIR, else ~/.cache/tern/models/embeddinggemma-300m,
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

# The CUDA compile check (cuda::tests::every_cuda_source_compiles_for_sm_90) needs NVRTC but no
# GPU: the NVRTC 13.0 of the device machines' driver, from its PyPI wheel, plus the CUDA headers
# of the runtime wheel. Installed once into a cache folder; without them that test fails.
nvrtc_dir="${TERN_NVRTC_DIR:-$HOME/.cache/tern/nvrtc}"
nvrtc_lib="$nvrtc_dir/nvidia/cu13/lib"
if [ ! -f "$nvrtc_lib/libnvrtc.so.13" ] || [ ! -f "$nvrtc_dir/nvidia/cu13/include/cuda_bf16.h" ]; then
  echo "installing NVRTC 13.0 into $nvrtc_dir for the CUDA compile check" >&2
  python3 -m pip install -q --disable-pip-version-check --target "$nvrtc_dir" \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-cuda-runtime==13.0.96"
fi
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TERN_CUDA_INCLUDE="$nvrtc_dir/nvidia/cu13/include"

cargo test --release "$@"

# The device tests (ignored above) on hostcuda, the CUDA entry points executed on the CPU; a run
# with a test filter is one of the tests above only.
if [ $# -eq 0 ]; then
  bash scripts/test-hostcuda.sh
fi
