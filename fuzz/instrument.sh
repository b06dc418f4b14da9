#!/usr/bin/env bash
# RUSTC_WORKSPACE_WRAPPER for fuzz/run.sh: cargo calls it, instead of rustc, for this
# workspace's own crates only (the library and the fuzz targets), so libFuzzer's coverage
# instrumentation, `cfg(fuzzing)`, debug assertions and overflow checks go into them
# alone, and every dependency is the test command's build, unchanged and shared. The
# flags are those cargo-fuzz gives with `--sanitizer none`; all are stable rustc flags.
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
  -Coverflow-checks
