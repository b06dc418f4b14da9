#!/usr/bin/env bash
# Speculative decoding on the demo model at one row, alternated with plain decoding:
# a copy-heavy task (reproduce a paragraph with two edits), greedy chat, and sampled chat.
# Usage: bench/speculative.sh [ROUNDS] [DRAFT_TOKENS]   (prints one JSON line per run,
# then the median tokens/s ratios and acceptance rates). MAX_TOKENS (200) sets each
# answer's length; CI runs one short round for the tokens' identity, which fails the run
# (exit 1) when speculation changes a token.
set -euo pipefail
ROUNDS=${ROUNDS:-${1:-5}}
K=${2:-8}
MAX_TOKENS=${MAX_TOKENS:-200}
BIN=${GENERATE:-${CARGO_TARGET_DIR:-target}/release/examples/generate}
DIR=$(mktemp -d)
cat > "$DIR/copy.txt" <<'TXT'
Rewrite the following paragraph exactly, word for word, but change "lighthouse" to "beacon" and "nine" to "ten":

The lighthouse stood at the end of the rocky point, its white tower streaked with salt and rust. Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again to put it out. Ships passing in the night saw the beam sweep across the water once every nine seconds, and the fishermen of the village set their watches by it. In winter the storms came in from the west, and the waves broke so high against the rocks that the spray reached the gallery windows.
TXT
echo "Give me three tips for learning a new language." > "$DIR/chat.txt"
echo "Tell me about your favourite season of the year and why you like it." > "$DIR/sampled.txt"
for round in $(seq "$ROUNDS"); do
  for task in copy chat sampled; do
    for mode in plain ngram; do
      extra=()
      [ "$mode" = ngram ] && extra=(--speculative ngram --draft-tokens "$K")
      # "sampled": free-form chat at temperature 0.7 (greedy chat from a 135M model
      # tends to loop, which prompt lookup predicts well).
      [ "$task" = sampled ] && extra+=(--temperature 0.7 --seed 3)
      file=$task; [ "$task" = sampled ] && file=sampled
      "$BIN" --chat --prompt-file "$DIR/$file.txt" --max-tokens "$MAX_TOKENS" --json \
        --precision "${PRECISION:-fast}" "${extra[@]}" 2>/dev/null |
        python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'round':$round,'task':'$task','mode':'$mode','tps':d['decode_tokens_per_s'],'draft':d['draft_tokens'],'accepted':d['accepted_draft_tokens'],'tokens':len(d['tokens']),'hash':hash(tuple(d['tokens']))}))"
    done
  done
done | tee "$DIR/runs.jsonl"
python3 - "$DIR/runs.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
for task in ("copy", "chat", "sampled"):
    ratios, acc = [], []
    for r in sorted({x["round"] for x in runs}):
        p = next(x for x in runs if x["round"] == r and x["task"] == task and x["mode"] == "plain")
        s = next(x for x in runs if x["round"] == r and x["task"] == task and x["mode"] == "ngram")
        assert p["hash"] == s["hash"], f"round {r}, {task}: speculation changed the tokens"
        ratios.append(s["tps"] / p["tps"])
        acc.append(s["accepted"] / max(s["draft"], 1))
    print(f"{task}: median speedup {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
          f"acceptance {statistics.median(acc):.0%}, identical tokens in every round")
PY
