#!/usr/bin/env bash
# The library's test suites under AddressSanitizer and UndefinedBehaviorSanitizer (LibTorch 1.13).
#
#   scripts/sanitize-check.sh                  # configure build-asan/, build the suites below, run them
#   scripts/sanitize-check.sh test_comm ...    # only these suites (CTest names = binaries)
#   FSDP_ASAN_BUILD_DIR=out scripts/sanitize-check.sh
#   scripts/sanitize-check.sh --thread         # build-tsan/: ThreadSanitizer over the threaded suites
#
# Not part of CI: a from-scratch build of the suites takes ~45 minutes on 2 cores and their run
# ~20 (docs/building.md, "Sanitizers"). Run it after a change to memory handling: the buffer pool,
# the parameter group's buffers, the collectives' copies, hooks that hold tensors.
#
# Our code (library, tests, tools) is compiled with -fsanitize=address,undefined; LibTorch is
# Debian's, uninstrumented, so a fault inside it is found only where ASan's allocator sees it (its
# tensors are malloc'ed: a use after free of a tensor's memory is caught, whoever reads it).
#   - vptr is off: its checks need RTTI of every class involved, and LibTorch's are in an
#     uninstrumented library;
#   - detect_container_overflow=0: LibTorch's std::vector code is not annotated, so vectors passed
#     between it and us would report overflows that are not;
#   - detect_leaks=0: LibTorch keeps its registries and thread pools to exit by design;
#   - detect_odr_violation=0: the tests link the library's static archive beside LibTorch's copies
#     of a few inline globals;
#   - halt_on_error=1 (UBSan): undefined behaviour fails the rank, hence the suite, also in the
#     rank processes a suite starts, whose output a passing suite does not print.
# test_meta_init asserts how much a rank's peak memory grows while it materialises its shards, and
# ASan's quarantine (freed memory held back to catch a use after free) counts there: it runs with
# the quarantine off (quarantine_size_mb=0), alone, so that use after free stays caught everywhere
# else. The other suites that read RSS (test_buffer_pool, test_fsdp1's ordering) pass with it on.
#
# --thread: ThreadSanitizer instead (build-tsan/, FSDP_TSAN_BUILD_DIR), over the suites where our
# own threads run (the async checkpoint saver, the runtime's shutdown thread, the collectives'
# waits, the desync check and the flight recorder). LibTorch is not instrumented, so its reference
# counts and condition variables look like races: scripts/tsan-suppressions.txt drops every report
# that passes through LibTorch, which leaves races between our own threads on our own memory.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=address
if [ "${1:-}" = "--thread" ]; then
  MODE=thread
  shift
fi
if [ "$MODE" = thread ]; then
  BUILD="${FSDP_TSAN_BUILD_DIR:-build-tsan}"
  SUITES=(test_comm test_flight_recorder test_desync test_checkpoint test_dist test_fully_shard test_replicate)
  sanitize="thread"
  flags="-fsanitize=thread -fno-omit-frame-pointer -g1"
else
  BUILD="${FSDP_ASAN_BUILD_DIR:-build-asan}"
  SUITES=(
    test_buffer_pool test_comm test_p2p_collectives test_pieces_collectives test_async_watch test_dist
    test_device_mesh test_mesh_from_groups test_desync test_flight_recorder
    test_fully_shard test_fully_shard_local test_fused_copies test_mixed_precision
    test_hsdp test_replicate test_meta_init test_clip_grad test_custom_collectives test_forward_hooks
    test_forward_method test_shard_placement test_world_of_one test_optimizers
    test_tensor_parallel test_tp_units test_fsdp1 test_fsdp1_wrap
    test_activation_checkpointing test_activation_checkpointing_fsdp test_attention
    test_safetensors test_checkpoint test_checkpoint_boxes test_checkpoint_safety test_state_dict
    test_state_dict_options test_data test_llama_hf
    test_train_gpt test_train_gpt_checkpoints
  )
  sanitize="address,undefined"
  flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-omit-frame-pointer -g1"
fi
QUARANTINE_OFF=(test_meta_init)
if (($#)); then SUITES=("$@"); fi

if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$sanitize" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=$sanitize" >/dev/null
fi
# The trainer's suites depend on train_gpt and fsdprun (tests/trainer/CMakeLists.txt): built with them.
nice cmake --build "$BUILD" --target "${SUITES[@]}"

base="detect_leaks=0:detect_odr_violation=0:detect_container_overflow=0:abort_on_error=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:suppressions=$PWD/scripts/tsan-suppressions.txt"
failed=()
for s in "${SUITES[@]}"; do
  opts="$base"
  for q in "${QUARANTINE_OFF[@]}"; do [ "$s" = "$q" ] && opts="$base:quarantine_size_mb=0:thread_local_quarantine_size_kb=0"; done
  if ! ASAN_OPTIONS="$opts" ctest --test-dir "$BUILD" --output-on-failure -R "^${s}\$" >"$BUILD/$s.sanitize.log" 2>&1; then
    failed+=("$s")
    echo "sanitize-check: $s FAILED (log: $BUILD/$s.sanitize.log)"
    grep -E "ERROR: AddressSanitizer|WARNING: ThreadSanitizer|runtime error|Failure" "$BUILD/$s.sanitize.log" | head -5 || true
  else
    echo "sanitize-check: $s passed"
  fi
done
if ((${#failed[@]})); then
  echo "sanitize-check: ${#failed[@]} of ${#SUITES[@]} suites failed: ${failed[*]}"
  exit 1
fi
if [ "$MODE" = thread ]; then
  echo "sanitize-check: all ${#SUITES[@]} suites passed under TSan (reports through LibTorch suppressed)"
else
  echo "sanitize-check: all ${#SUITES[@]} suites passed under ASan and UBSan"
fi
