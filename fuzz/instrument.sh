#!/usr/bin/env bash
# RUSTC_WORKSPACE_WRAPPER for fuzz/run.sh: cargo calls it, instead of rustc, for this
# workspace's own crates only (the library and the fuzz targets), so libFuzzer's coverage
# instrumentation, `cfg(fuzzing)`, debug assertions and overflow checks go into them
# alone, and every dependency is the test command's build, unchanged and shared. The
# flags are those cargo-fuzz gives with `--sanitizer none`; all are stable rustc flags.
# Then opt-level 1 and no debug information for these two crates alone: the library
# compiles in 425 s instead of 992 s on the 2-core CI machine (2026-11-29), and a target
# runs about 0.7 to 1.2 times as many inputs in its 20 s (chat_template 71k against
# 104k, gguf_header 468k against 442k).
rustc="$1"
shift
case " $* " in
  *" --crate-name build_script_"*) exec "$rustc" "$@" ;;  # build scripts run, not fuzzed
esac
exec "$rustc" "$@" \
  -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares \
  --cfg fuzzing \
  -Cdebug-assertions \
  -Coverflow-checks \
  -Copt-level=1 \
  -Cdebuginfo=0
