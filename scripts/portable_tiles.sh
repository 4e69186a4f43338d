#!/usr/bin/env bash
# The compiled tiles' portable code paths, the ones written for CPUs without AVX-512 (the
# row tails' lane loops, plain copies where streaming stores would go, bfloat16 rounded in
# software): a build for x86-64-v3 (AVX2 and FMA, ATTNGRAD_MARCH) in a fresh cache runs the
# tile tests, then every pass of scripts/tile_bits.py's grid, whose results must equal the
# native build's bit for bit; and a build without OpenMP (the suite leaves that 10 s build
# to this script). Run it, as sanitize_tiles.sh, before any change to
# src/attngrad/torch/backends/cpu_tiles/ (csrc/ or build.py) lands:
#     scripts/portable_tiles.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
python scripts/tile_bits.py save "$cache/native.pt"
export ATTNGRAD_MARCH=x86-64-v3 ATTNGRAD_CACHE="$cache"
python - <<'PY'
from attngrad.torch.backends.cpu_tiles import build as native_build, native
assert native.library() is not None, native.build_info.reason
assert "-march=x86-64-v3" in native_build.flags(), native_build.flags()
print(f"built for x86-64-v3: {native.build_info.path}")
PY
python -m pytest -q -p no:cacheprovider \
    tests/attngrad_torch/backends/cpu_tiles/test_native.py tests/attngrad_torch/backends/cpu_tiles/test_tiling.py \
    tests/attngrad_torch/backends/cpu_tiles/test_tile_map.py tests/attngrad_torch/backends/cpu_tiles/test_half_precision.py \
    tests/attngrad_torch/backends/cpu_tiles/test_build.py tests/attngrad_torch/op/test_determinism.py \
    tests/attngrad_torch/masks/test_structured.py tests/attngrad_torch/op/test_sinks.py tests/attngrad_torch/op/test_forward_jvp.py \
    tests/attngrad_torch/backends/cpu_tiles/test_fast_entry.py \
    -k "not test_compiled_ and not in_triton" "$@"
python scripts/tile_bits.py compare "$cache/native.pt"
ATTNGRAD_BUILD_TESTS=1 python -m pytest -q -p no:cacheprovider tests/attngrad_torch/backends/cpu_tiles/test_build.py -k without_openmp
