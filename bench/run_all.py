"""`./dev bench`: every benchmark, one after the other, and a summary table.

Each benchmark runs in its own process (they start their own servers and workers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

RUNS = [
    ("burn-down, 20,000 no-op tasks, 1 worker process, concurrency 64", ["burndown.py", "--json"]),
    ("submit→start at 1,000 tasks/s, 100 calls/s of 10 tasks", ["latency.py", "--batch", "10", "--json"]),
    ("submit→start at 1,000 tasks/s, one SubmitTask per task", ["latency.py", "--batch", "1", "--json"]),
    ("submit→start at 300 tasks/s, one SubmitTask per task", ["latency.py", "--rate", "300", "--json"]),
]


def main() -> None:
    rows = []
    for title, cmd in RUNS:
        print(f"== {title}", file=sys.stderr, flush=True)
        out = subprocess.run(
            [sys.executable, str(HERE / cmd[0]), *cmd[1:], *sys.argv[1:]], check=True, stdout=subprocess.PIPE, text=True
        ).stdout
        rows.append((title, json.loads(out.strip().splitlines()[-1])))
    print("\n| run | result |\n|---|---|")
    for title, r in rows:
        if "drain_tasks_per_s" in r:
            text = f"{r['drain_tasks_per_s']:,} tasks/s drained ({r['submit_tasks_per_s']:,} tasks/s submitted)"
        else:
            text = (
                f"p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, p99 {r['p99_ms']} ms (achieved {r['achieved_rate']:,}/s)"
            )
        print(f"| {r['store']}: {title} | {text} |")


if __name__ == "__main__":
    main()
