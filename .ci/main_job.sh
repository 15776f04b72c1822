#!/usr/bin/env bash
# The main job on a clean checkout, as a new user runs it: `make demo` in a fresh clone of the
# committed tree (fresh .venv, no test extras), then eval / score / export on the run it wrote and a
# wheel in an empty venv. Fails on the first command that fails.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/rewardax"
cd "$work/rewardax"

echo "== make demo (fresh clone, fresh .venv)"
make demo | tee "$work/demo.out"
if .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "FAIL: torch is importable in the demo's .venv; rewardax must not need it" >&2
  exit 1
fi
run_dir="$(tail -n 1 "$work/demo.out" | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["run_dir"])')"
echo "== run: $run_dir"

# Held-out pairs longer than the run's 64-token limit: four held-out sentences of each side joined.
.venv/bin/python - "$work/long.jsonl" "$work/rows.jsonl" <<'EOF'
import json, sys
from importlib.resources import files
rows = [json.loads(line) for line in (files("rewardax") / "assets" / "vader_movie_pairs.heldout.jsonl").read_text().splitlines()]
with open(sys.argv[1], "w") as out:
    for i in range(0, 64, 4):
        group = rows[i : i + 4]
        out.write(json.dumps({"prompt": group[0]["prompt"], "chosen": " ".join(r["chosen"] for r in group), "rejected": " ".join(r["rejected"] for r in group)}) + "\n")
with open(sys.argv[2], "w") as out:
    for r in rows[:8]:
        out.write(json.dumps({"prompt": r["prompt"], "response": r["chosen"]}) + "\n")
EOF

echo "== rewardax eval on long held-out rows"
.venv/bin/rewardax eval --model "$run_dir/export" --data "$work/long.jsonl" | tee "$work/eval.out"
tail -n 1 "$work/eval.out" | .venv/bin/python -c '
import json, sys
m = json.load(sys.stdin)["metrics"]
assert m["num_pairs"] == 16 and m["num_truncated"] > 0, m
print("eval:", m["num_pairs"], "pairs,", m["num_truncated"], "truncated, accuracy", m["accuracy"])'

echo "== rewardax score"
.venv/bin/rewardax score --model "$run_dir/export" --input "$work/rows.jsonl" --output "$work/scored.jsonl" --normalize
test "$(wc -l < "$work/scored.jsonl")" -eq 8

echo "== rewardax export from the run's checkpoints"
.venv/bin/rewardax export --checkpoint "$run_dir" --output "$work/exported"
test -f "$work/exported/config.json"

echo "== the wheel in an empty venv"
make wheel
python3 -m venv "$work/wheel-venv"
"$work/wheel-venv/bin/python" -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r requirements-demo.lock
"$work/wheel-venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps dist/rewardax-*.whl
(cd "$work" && "$work/wheel-venv/bin/rewardax" --help >/dev/null && "$work/wheel-venv/bin/rewardax" train --help >/dev/null)
echo "main job: OK"
