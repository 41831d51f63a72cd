"""How long the dashboard's overview and task list take to load with many tasks in the store,
measured in Debian's headless Chromium (Playwright with executable_path): the view's API calls
and drawing (main[data-loaded-ms]) and the whole page from navigation to the view drawn
(main[data-page-ms]), median of several fresh loads.

    python bench/dashboard_load.py [--tasks 100000] [--loads 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from _servers import BenchServer

CHROMIUM = "/usr/bin/chromium"
STATES = ["", "PENDING", "SUCCEEDED"]


def submit_many(url: str, total: int, batch: int = 1000) -> None:
    for start in range(0, total, batch):
        tasks = [{"pool": "default", "payload_json": {"n": n}} for n in range(start, min(start + batch, total))]
        req = urllib.request.Request(url + "/v1/batches", data=json.dumps({"tasks": tasks}).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--loads", type=int, default=7)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp))
        try:
            started = time.monotonic()
            submit_many(server.http_url, args.tasks)
            print(f"submitted {args.tasks} tasks in {time.monotonic() - started:.1f}s")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                page = browser.new_page()
                views = [
                    ("overview", "#/overview"),
                    ("tasks", "#/tasks"),
                    ("tasks", "#/tasks?pool=default&state=PENDING"),
                ]
                for view, hash_ in views:
                    times, pages = [], []
                    for _ in range(args.loads):
                        page.goto("about:blank")
                        page.goto(f"{server.http_url}/ui/{hash_}")
                        page.wait_for_selector(f'main[data-view="{view}"]', timeout=30_000)
                        times.append(int(page.get_attribute("main", "data-loaded-ms") or -1))
                        pages.append(int(page.get_attribute("main", "data-page-ms") or -1))
                    print(
                        f"{hash_:38} view median {statistics.median(times)} ms (max {max(times)}); "
                        f"page median {statistics.median(pages)} ms (max {max(pages)}); {args.loads} loads"
                    )
                browser.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
