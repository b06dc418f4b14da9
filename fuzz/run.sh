#!/usr/bin/env bash
# Builds the fuzz targets (libFuzzer) and runs each for SECONDS_PER_TARGET (default 20)
# from a copy of its committed seeds, after replaying its regression inputs; prints the
# inputs each target tried and fails when one crashes (a panic, an input that runs past
# -timeout, one allocation over -malloc_limit_mb or memory over -rss_limit_mb). New
# corpus entries go to a scratch directory, never into the repository; a crashing input
# is left there (the path is printed).
#
#   fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
#
# CARGO_TARGET_DIR: the build directory (default ~/.cache/llama-burn/target, the test
# command's: the targets reuse its dependencies).
# FUZZ_SCRATCH: where the corpora and crash inputs go (default: a new temporary dir).
set -euo pipefail
cd "$(dirname "$0")"

seconds="${1:-20}"
shift || true
if [ $# -gt 0 ]; then
  targets=("$@")
else
  targets=()
  for file in fuzz_targets/*.rs; do
    name="${file##*/}"
    targets+=("${name%.rs}")
  done
fi

# The stable toolchain and plain cargo, not cargo-fuzz on nightly: `instrument.sh` adds
# libFuzzer's coverage instrumentation (stable rustc flags) to this workspace's crates
# only, so every dependency is the README's test command's build, reused as it is. A
# cold CI machine compiles the instrumented library and libFuzzer (minutes) instead of
# the whole tree again with cargo-fuzz's flags (42 minutes). No address sanitizer: the
# targets run safe Rust (ASan finds memory errors in unsafe code, which these paths do
# not reach), and it needs nightly and an instrumented standard library.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/llama-burn/target}"
start=$(date +%s)
# The build's output goes to a file (not through `tee /dev/stderr`, which reopens a log
# file that stderr is and truncates it), printed whole if the build fails.
echo "fuzz: building the instrumented library and the targets (minutes when the crate changed)" >&2
build_log="$(mktemp -t llama-burn-fuzz-build.XXXXXX)"
if ! RUSTC_WORKSPACE_WRAPPER="$PWD/instrument.sh" \
  cargo build --release -p llama-burn-fuzz --bins --message-format=short >"$build_log" 2>&1; then
  cat "$build_log" >&2
  echo "fuzz: the build failed" >&2
  exit 1
fi
awk '/^ *Compiling/ {n++; names = names " " $2} END {print "fuzz: compiled " n + 0 " crates:" names}' "$build_log" >&2
rm -f "$build_log"
echo "fuzz: built in $(( $(date +%s) - start ))s" >&2
bin="$CARGO_TARGET_DIR/release"

scratch="${FUZZ_SCRATCH:-$(mktemp -d -t llama-burn-fuzz.XXXXXX)}"
failed=()
for target in "${targets[@]}"; do
  dir="$scratch/$target"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  cp corpus/"$target"/* "$dir/corpus/"
  # A fixed seed (a run is repeatable on one build); a 10 s limit per input; memory
  # bounds that a real input never nears (the inputs are at most 16 KiB), so that an
  # allocation sized by a count an input claims fails the run.
  flags=(-seed=1 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=256 -max_len=16384
         -print_final_stats=1 -artifact_prefix="$dir/artifacts/")
  log="$dir/log"
  status=0
  if compgen -G "regressions/$target/*" >/dev/null; then
    "$bin/$target" "${flags[@]}" regressions/"$target"/* >"$log" 2>&1 || status=$?
  fi
  if [ "$status" -eq 0 ]; then
    "$bin/$target" "${flags[@]}" -max_total_time="$seconds" "$dir/corpus" >>"$log" 2>&1 || status=$?
  fi
  runs=$(awk '/stat::number_of_executed_units/ {n = $2} END {print n + 0}' "$log")
  if [ "$status" -ne 0 ]; then
    failed+=("$target")
    echo "fuzz: $target FAILED (exit $status) after $runs inputs; log $log, input in $dir/artifacts/"
    tail -n 40 "$log"
  else
    echo "fuzz: $target: $runs inputs in ${seconds}s"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashed: ${failed[*]}"
  exit 1
fi
