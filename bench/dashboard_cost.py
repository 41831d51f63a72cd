"""What an open dashboard page costs the server: the burn-down (bench/burndown.py) with no page,
with the overview open (it re-reads the snapshot every 5 s) and with the live view open (every
event streamed to the page), in alternating rounds; the median of each and its ratio to none.

    python bench/dashboard_cost.py [--tasks 20000] [--rounds 3] [--store sqlite|postgres] [--json]

The page runs in Debian's headless Chromium on the same two cores as the server and the worker,
so the figure includes the browser's own work (a page on another machine costs the server less).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _servers import add_store_arguments, bench_store

HERE = Path(__file__).parent
PAGES = ("", "overview", "live")


def burn(tasks: int, page: str, store_args: list[str]) -> int:
    args = [sys.executable, str(HERE / "burndown.py"), "--tasks", str(tasks), "--json", *store_args]
    if page:
        args += ["--dashboard", page]
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout
    return int(json.loads(out.strip().splitlines()[-1])["drain_tasks_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    runs: dict[str, list[int]] = {p: [] for p in PAGES}
    with bench_store(args.store, args.url) as url:
        store_args = ["--store", args.store] + (["--url", url] if url else [])
        for _ in range(args.rounds):
            for page in PAGES:
                runs[page].append(burn(args.tasks, page, store_args))
    median = {p or "none": statistics.median(r) for p, r in runs.items()}
    result = {
        "store": args.store,
        "tasks": args.tasks,
        "rounds": args.rounds,
        "runs": {p or "none": r for p, r in runs.items()},
        "median_tasks_per_s": median,
        "overview_ratio": round(median["overview"] / median["none"], 3),
        "live_ratio": round(median["live"] / median["none"], 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    for page, value in median.items():
        each = runs["" if page == "none" else page]
        print(f"{args.store} burn-down, dashboard page {page:8}: median {value:,.0f} tasks/s of {each}")
    print(f"ratio to no page: overview {result['overview_ratio']}, live {result['live_ratio']}")


if __name__ == "__main__":
    main()
