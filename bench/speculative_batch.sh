#!/usr/bin/env bash
# Speculative decoding in the continuous engine's batches, alternated with plain decoding:
# 16 requests of 128 tokens, every one speculating or 8 of them beside 8 plain ones,
# greedy and at temperature 1. Usage: bench/speculative_batch.sh [ROUNDS] (prints one
# JSON line per run, then median throughput ratios and acceptance). REQUESTS (16) and
# MAX_TOKENS (128) set the size (4 requests of 96 tokens propose no draft token: the
# check needs the default size); it fails the run (exit 1) when speculation changes an
# output.
set -euo pipefail
ROUNDS=${1:-3}
REQUESTS=${REQUESTS:-16}
MAX_TOKENS=${MAX_TOKENS:-128}
BIN=${BENCH:-${CARGO_TARGET_DIR:-target}/release/examples/benchmark_concurrency}
OUT=$(mktemp)
for round in $(seq "$ROUNDS"); do
  for temp in 0 1; do
    for mix in all half; do
      # Alternate which mode goes first, so drift favours neither.
      order="plain ngram"; [ $((round % 2)) = 0 ] && order="ngram plain"
      for mode in $order; do
        extra=()
        [ "$mode" = ngram ] && extra=(--speculative ngram --draft-tokens 8)
        [ "$mode" = ngram ] && [ "$mix" = half ] && extra+=(--speculative-requests $((REQUESTS / 2)))
        "$BIN" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" --strategies continuous --temperature "$temp" \
          --json "${extra[@]}" 2>/dev/null |
          python3 -c "import hashlib,json,sys; d=json.load(sys.stdin); r=d['results'][0]; print(json.dumps({'round':$round,'requests':$REQUESTS,'temp':$temp,'mix':'$mix','mode':'$mode','tps':r['tokens_per_s'],'draft':r['draft_tokens'],'accepted':r['accepted_draft_tokens'],'hash':hashlib.sha256(str(r['outputs']).encode()).hexdigest()[:16]}))"
      done
    done
  done
done | tee "$OUT"
python3 - "$OUT" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
if sum(r["draft"] for r in runs) == 0:
    print("note: no draft token was proposed (too few or too short requests): the identity check compared plain runs")
for temp in (0, 1):
    for mix in ("all", "half"):
        sel = [r for r in runs if r["temp"] == temp and r["mix"] == mix]
        ratios, plain, spec, acc = [], [], [], []
        for rnd in sorted({r["round"] for r in sel}):
            p = next(r for r in sel if r["round"] == rnd and r["mode"] == "plain")
            s = next(r for r in sel if r["round"] == rnd and r["mode"] == "ngram")
            assert p["hash"] == s["hash"], f"round {rnd}, t={temp}, {mix}: speculation changed the outputs"
            ratios.append(s["tps"] / p["tps"]); plain.append(p["tps"]); spec.append(s["tps"])
            acc.append(f"{s['accepted']}/{s['draft']}")
        n = max(r["requests"] for r in sel)
        rows = f"{n} speculating" if mix == "all" else f"{n // 2} speculating + {n - n // 2} plain"
        print(f"t={temp}, {rows}: {statistics.median(spec):.0f} vs {statistics.median(plain):.0f} tokens/s, "
              f"median ratio {statistics.median(ratios):.2f} (rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
              f"accepted/proposed {', '.join(acc)}; identical outputs in every pair")
PY
