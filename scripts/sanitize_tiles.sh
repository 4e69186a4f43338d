#!/usr/bin/env bash
# The compiled tiles' tests against a build with AddressSanitizer and
# UndefinedBehaviorSanitizer (ATTNGRAD_SANITIZE=1 in attngrad.torch.backends.cpu_tiles.build: the
# extension's sources compiled and linked with -fsanitize=address,undefined), in a fresh
# cache folder. Run it before any change to src/attngrad/torch/backends/cpu_tiles/csrc lands:
#     scripts/sanitize_tiles.sh [extra pytest arguments]
# A Python process loads the sanitizer runtimes before anything else (LD_PRELOAD); leak
# checking is off because CPython and PyTorch keep allocations until exit by design;
# --capture=sys leaves standard error to the sanitizers, whose report would be lost with it.
# torch.compile's tests are left out (-k): slow under the sanitizers, and no tiles of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
cxx="${CXX:-c++}"
cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
export ATTNGRAD_SANITIZE=1 ATTNGRAD_CACHE="$cache"
export LD_PRELOAD="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libubsan.so)"
export ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
python -m pytest -q -p no:cacheprovider --capture=sys \
    tests/attngrad_torch/backends/cpu_tiles/test_native.py tests/attngrad_torch/backends/cpu_tiles/test_tiling.py \
    tests/attngrad_torch/backends/cpu_tiles/test_tile_map.py tests/attngrad_torch/backends/cpu_tiles/test_half_precision.py \
    tests/attngrad_torch/backends/cpu_tiles/test_build.py tests/attngrad_torch/op/test_determinism.py \
    tests/attngrad_torch/test_input_range.py tests/attngrad_torch/op/test_op_contract.py \
    tests/attngrad_torch/masks/test_structured.py tests/attngrad_torch/op/test_placement.py tests/attngrad_torch/op/test_sinks.py \
    tests/attngrad_torch/masks/test_blocks.py tests/attngrad_torch/op/test_forward_jvp.py tests/attngrad_torch/backends/cpu_tiles/test_buffer_cache.py \
    tests/attngrad_torch/test_eager_plans.py tests/attngrad_torch/backends/cpu_tiles/test_fast_entry.py \
    -k "not test_compiled_ and not in_triton" "$@"
python - <<'PY'
from attngrad.torch.backends.cpu_tiles import native
assert native.library() is not None, native.build_info.reason
binary = native.build_info.path.read_bytes()  # the extension the tests above loaded
assert b"__asan_init" in binary and b"__ubsan_handle" in binary, "the tiles were not built with the sanitizers"
print(f"the tests above ran on {native.build_info.path}, built with ASan and UBSan")
PY
