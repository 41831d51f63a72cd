"""Per-key rate: 50 keys of one keyed rate resource (per_key), each limited to 20 starts a second.

The tasks are submitted in turns across the keys (--by-key: all of one key, then the next).
Every key has enough tasks to stay at its limit for more than 12 s; one worker process drains
them (concurrency 64, no-op handler). From the tasks' start times (the server's, as leased), per
key: the starts in each whole second of the 10 s after the first second (the first holds the
burst), and the most in any 1 s window over the whole run. Printed: the lowest and highest of
those counts (and their median) over all keys and seconds, against the limit (target: every key within ±1 of it
per second, none above).

    python bench/keyed_rate.py [--store postgres] [--keys 50] [--rate 20] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _servers import BenchServer, add_store_arguments, bench_store
from burndown import SDK_PREFETCH, run_worker, wait_all_done

import cronoq


async def start_times(endpoint: str) -> dict[str, list[float]]:
    """Each key's tasks' start times (seconds), sorted."""
    starts: dict[str, list[float]] = {}
    async with cronoq.Client(endpoint) as client:
        async for t in client.iter_tasks(state=cronoq.TaskState.Value("TASK_STATE_SUCCEEDED"), page_size=1000):
            [entry] = t.resources
            starts.setdefault(entry, []).append(t.started_at.ToMicroseconds() / 1e6)
    return {k: sorted(v) for k, v in starts.items()}


def most_in_a_second(starts: list[float]) -> int:
    return max(bisect.bisect_left(starts, s + 1.0) - i for i, s in enumerate(starts))


async def submit_keys(endpoint: str, keys: int, per_key: int, by_key: bool) -> None:
    """per_key tasks of each key: all of one key, then the next (by_key), or in turns."""
    async with cronoq.Client(endpoint) as client:
        if by_key:
            for k in range(keys):
                await client.submit_batch([spec(k) for _ in range(per_key)])
        else:
            for _ in range(per_key):
                await client.submit_batch([spec(k) for k in range(keys)])


def spec(key: int) -> Any:
    return cronoq.task_spec("default", b"", resources={f"quota:customer-{key}": 1})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--rate", type=int, default=20)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--by-key", action="store_true", help="submit every task of one key, then the next")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    add_store_arguments(ap)
    args = ap.parse_args()
    per_key = args.rate * (args.seconds + 3)  # at the limit for the whole measured span
    total = args.keys * per_key
    extra = f'[[resources]]\nname = "quota"\nrate = {args.rate}\nburst = 1\nper_key = true\n'
    with bench_store(args.store, args.url) as url, tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp), url, extra_config=extra)
        try:
            asyncio.run(submit_keys(server.endpoint, args.keys, per_key, args.by_key))
            spawn = mp.get_context("spawn")  # not a fork: see burndown.py
            started_at, done_at = spawn.Value("d", 0.0), spawn.Value("d", 0.0)
            proc = spawn.Process(
                target=run_worker, args=(server.endpoint, 64, SDK_PREFETCH, total, started_at, done_at, {})
            )
            proc.start()
            proc.join(600)
            assert asyncio.run(wait_all_done(server.endpoint, total, {})) == total
            starts = asyncio.run(start_times(server.endpoint))
        finally:
            server.stop()
    t0 = min(s[0] for s in starts.values()) + 1.0
    per_second = [
        bisect.bisect_left(s, t0 + i + 1) - bisect.bisect_left(s, t0 + i)
        for s in starts.values()
        for i in range(args.seconds)
    ]
    result: dict[str, Any] = {
        "store": args.store,
        "order": "by key" if args.by_key else "in turns",
        "keys": len(starts),
        "rate": args.rate,
        "seconds": args.seconds,
        "per_second_min": min(per_second),
        "per_second_median": statistics.median(per_second),
        "per_second_max": max(per_second),
        "within_1": sum(1 for n in per_second if abs(n - args.rate) <= 1),
        "key_seconds": len(per_second),
        "most_in_any_second": max(most_in_a_second(s) for s in starts.values()),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(keyed_rate_text(result))


def keyed_rate_text(r: dict[str, Any]) -> str:
    return (
        f"{r['keys']} keys at {r['rate']}/s, submitted {r['order']}: per key and whole second "
        f"{r['per_second_min']}–{r['per_second_max']} starts (median {r['per_second_median']:g}, "
        f"{r['within_1']}/{r['key_seconds']} within ±1); "
        "the most in any 1 s window "
        f"{r['most_in_any_second']} (rate + burst {r['rate'] + 1})"
    )


if __name__ == "__main__":
    main()
