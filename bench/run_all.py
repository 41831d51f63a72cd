"""`./dev bench`: every benchmark in one run, and a summary table.

cronoq on SQLite and on PostgreSQL (burn-down, submit→start and submit→Watch event latency, another
caller's latency during a bulk retry of 50,000 FAILED tasks, a store full of ended tasks (the
drain beside them, their purge past retention, bulk and single deletes) and debounced
submissions, fair share inside a pool (the burn-down over 1 to 100,000 groups, the noisy
neighbour), the rate per key of a keyed rate
resource, and two shards: forwarded calls,
ListTasks across shards, burn-down across shards, a workflow's fan-out of 10,000 children and a
join), then the anchors PgQueuer and procrastinate
on the same PostgreSQL server and the same workloads, and River's burn-down there too (built
with `go`; skipped when Go is missing), and cronoq's ratio to each; then submit latency under
idle load; the outbox (enqueue in the application's transactions, commit→start) beside River's
InsertTx. Each run is its own process with its own
servers and workers. `--quick` runs smaller sizes; `--no-anchors` skips the anchors;
`--throughput` runs the burn-downs only (cronoq's at concurrency 64 and 1000 with each SDK's
worker, at 64 with prefetch 0 beside the default (4 a slot), and the CPU each task costs,
PostgreSQL's for the store's Work steps alone (bench/store_steps.py), PgQueuer's, River's at
both settings), the submit path (bench/submit.py: SubmitBatch, POST /v1/batches, single
SubmitTask calls open loop; River's InsertMany and Insert beside them on PostgreSQL) and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from _servers import bench_store  # noqa: E402
from keyed_lease_cost import keyed_lease_text  # noqa: E402
from keyed_rate import keyed_rate_text  # noqa: E402
from submit import rows as submit_rows  # noqa: E402


def run(script: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(HERE / script), *args, "--json"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


# The wide concurrency of a worker, beside the 64 of the other burn-downs.
WIDE = 1000
# The prefetch of a worker at concurrency 64 in the burn-down beside the default's (4 a slot):
# none, as every SDK's worker held before prefetch was on by default.
PREFETCH = 0


def cpu_text(r: dict[str, Any]) -> str:
    """CPU µs per task during a burn-down: server / PostgreSQL / worker (no PostgreSQL on SQLite)."""
    cpu = r["cpu_us_per_task"]
    parts = [f"server {cpu['server']:.0f}"]
    if "postgres" in cpu:
        parts.append(f"PostgreSQL {cpu['postgres']:.0f}")
    parts.append(f"worker {cpu['worker']:.0f}")
    total = sum(cpu.values())
    return ", ".join(parts) + f" = {total:.0f} µs"


def dashboard_cost_text(r: dict[str, Any]) -> str:
    med = r["median_tasks_per_s"]
    return (
        f"none / overview / live: {med['none']:,.0f} / {med['overview']:,.0f} / {med['live']:,.0f} tasks/s "
        f"= 1 / {r['overview_ratio']:.3f}× / {r['live_ratio']:.3f}× (median of {r['rounds']})"
    )


def latency_text(r: dict[str, Any]) -> str:
    return f"p50 {r['p50_ms']} ms, p90 {r['p90_ms']} ms, p99 {r['p99_ms']} ms (achieved {r['achieved_rate']:,}/s)"


def bulk_text(r: dict[str, Any]) -> str:
    q, d = r["quiet"], r["during"]
    return (
        f"{r['bulk_s']} s ({r['calls']} call(s)); another caller's GetTask/SubmitTask p99 {q['p99_ms']} ms quiet, "
        f"{d['p99_ms']} ms during = {r['p99_ratio']}× (p50 {q['p50_ms']} → {d['p50_ms']} ms)"
    )


def sharding_rows(store: str, r: dict[str, Any]) -> list[tuple[str, str]]:
    """bench/sharding.py's figures as table rows."""

    def forwarded(kind: str) -> str:
        direct, fwd = r[f"{kind}_direct"], r[f"{kind}_forwarded"]
        return (
            f"p50 {direct['p50_ms']:.2f} → {fwd['p50_ms']:.2f} ms ({r[f'{kind}_forward_cost_p50_ms']:+.2f} ms), "
            f"p99 {direct['p99_ms']:.2f} → {fwd['p99_ms']:.2f} ms"
        )

    def burn(b: dict[str, Any]) -> str:
        two, one = b["2x1"], b["1x1"]
        per = " + ".join(f"{pool} {n:,}" for pool, n in two["per_pool_tasks_per_s"].items())
        return f"{two['tasks_per_s']:,} tasks/s ({per}) / {one['tasks_per_s']:,} tasks/s = {b['ratio']:.2f}×"

    fan_out = "fanned out" if r["list_fanned_out"] else "not fanned out: the receiving shard's answer"
    rows = [
        (f"cronoq {store}, 2 shards: GetTask direct → forwarded to the other shard", forwarded("get")),
        (f"cronoq {store}, 2 shards: SubmitTask direct → forwarded to the other shard", forwarded("submit")),
        (
            f"cronoq {store}, 2 shards: ListTasks, a page of 100 straddling both shards / inside one shard, p50",
            f"{r['list_client']['p50_ms']:.2f} / {r['list_one_shard']['p50_ms']:.2f} ms = {r['list_ratio_p50']:.2f}× "
            f"({fan_out}); the first page, which cpu fills: {r['list_first_page']['p50_ms']:.2f} ms",
        ),
        (
            f"cronoq {store}: burn-down over 2 shards, a worker process each / one server, one worker",
            burn(r["burn_down"]) + f"; one server with 2 workers: {r['burn_down']['1x2']['tasks_per_s']:,} tasks/s",
        ),
    ]
    if "burn_down_normal" in r:
        rows.append((f"cronoq {store}: the same, synchronous = normal", burn(r["burn_down_normal"])))
    return rows


def fair_share_rows(store: str, quick: bool, extra: list[str]) -> list[tuple[str, str]]:
    """Fair share inside a pool: the burn-down and a lease's cost over 1 to 100,000 groups (the
    same tasks, a pool with max_running_per_group), and the noisy neighbour (bench/fair.py)."""
    total = 20_000 if quick else 100_000
    drains: dict[int, int] = {}
    for wanted in (1, 100, 10_000, 100_000):
        groups = min(wanted, total)
        print(f"== cronoq on {store}: burn-down of {total:,} tasks over {groups:,} group(s)", file=sys.stderr)
        burn = run("burndown.py", "--tasks", str(total), "--groups", str(groups), *extra)
        drains[groups] = burn["drain_tasks_per_s"]
    one = drains[1]
    scale = ", ".join(f"{g:,}: {d:,} ({d / one:.2f}×)" for g, d in drains.items())
    print(f"== cronoq on {store}: a lease's cost over 1 to 100,000 groups", file=sys.stderr, flush=True)
    cost = run("lease_cost.py", "--tasks", str(total), "--leases", "100" if quick else "300", *extra)
    counts = [k for k in cost if k.isdigit()]
    print(f"== cronoq on {store}: noisy neighbour", file=sys.stderr, flush=True)
    fair = run("fair.py", "--tasks", "5000" if quick else "20000", "--rounds", "1" if quick else "3", *extra)
    plain, grouped = fair["plain"], fair["groups"]
    return [
        (
            f"cronoq {store}: burn-down of {total:,} tasks over N groups (max_running_per_group 1000), tasks/s "
            "(× the one-group case)",
            scale,
        ),
        (
            f"cronoq {store}: a lease of {cost['batch']} from {total:,} tasks over N groups, p50 / p99 ms "
            "(worst p50 × the one-group case)",
            ", ".join(f"{int(k):,}: {cost[k]['p50_ms']} / {cost[k]['p99_ms']}" for k in counts)
            + f" ({cost['worst_vs_one_group']}×); plain pool {cost['plain']['p50_ms']} / {cost['plain']['p99_ms']}",
        ),
        (
            f"cronoq {store}: noisy neighbour, B's {fair['late']} tasks behind A's {fair['tasks']:,}, start p50 / p99",
            f"plain pool {plain['b_start_p50_ms']:,} / {plain['b_start_p99_ms']:,} ms; group keys "
            f"(max_running_per_group {fair['cap']}) {grouped['b_start_p50_ms']:,} / {grouped['b_start_p99_ms']:,} ms; "
            f"drain {plain['drain_tasks_per_s']:,} → {grouped['drain_tasks_per_s']:,} tasks/s "
            f"({fair['drain_ratio']}×, median of {fair['rounds']})",
        ),
    ]


def history_rows(store: str, quick: bool, extra: list[str], step: Any) -> list[tuple[str, str]]:
    """A store full of ended tasks: the drain beside them, their purge past retention, bulk
    retry and delete, single deletes; and debounced submissions (bench/history.py)."""
    history = ["--history", "100000" if quick else "1000000"]
    step(f"cronoq on {store}: the drain beside ended tasks")
    drain = run("history.py", "drain", "--pending", "20000" if quick else "100000", *history, *extra)
    step(f"cronoq on {store}: the retention service purging ended tasks while another caller works")
    purge = run("history.py", "purge", *history, *extra)
    step(f"cronoq on {store}: bulk retry and bulk delete of FAILED tasks, DeleteTask beside ended tasks")
    delete = run("history.py", "delete", "--tasks", "5000" if quick else "20000", *history, *extra)
    step(f"cronoq on {store}: debounced submissions")
    debounce = run("history.py", "debounce", "--calls", "10000" if quick else "100000", *extra)
    q, d, single = purge["quiet"], purge["during"], delete["single"]
    return [
        (
            f"cronoq {store}: drain of {drain['pending']:,} no-op tasks, 1 worker process, concurrency 64, "
            f"no history / beside {drain['history']:,} ended tasks (target ≥ 0.8×)",
            f"{drain['empty_tasks_per_s']:,} / {drain['history_tasks_per_s']:,} tasks/s = {drain['ratio']}×",
        ),
        (
            f"cronoq {store}: the retention service purges {purge['history']:,} ended tasks; another caller's "
            "GetTask/SubmitTask meanwhile (target p99 ≤ 1.5× quiet)",
            f"{purge['purge_s']} s from the restart ({purge['rows_per_s']:,} rows/s); p99 {q['p99_ms']} ms quiet, "
            f"{d['p99_ms']} ms during = {purge['p99_ratio']}× (p50 {q['p50_ms']} → {d['p50_ms']} ms)",
        ),
        (
            f"cronoq {store}: RetryTasks / DeleteTasks of {delete['tasks']:,} FAILED tasks (target ≤ 2×)",
            f"{delete['retry']['s']} / {delete['delete']['s']} s = {delete['ratio']}×",
        ),
        (
            f"cronoq {store}: DeleteTask, one at a time, beside {delete['history']:,} ended tasks (target p99 ≤ 10 ms)",
            f"p50 {single['p50_ms']} ms, p99 {single['p99_ms']} ms ({single['calls']} calls)",
        ),
        (
            f"cronoq {store}: {debounce['calls']:,} SubmitTask with KEY_MODE_DEBOUNCE over {debounce['keys']} keys, "
            f"{debounce['callers']} callers",
            f"{debounce['submits_per_s']:,} submits/s, p50 {debounce['p50_ms']} ms, p99 {debounce['p99_ms']} ms; "
            f"{debounce['tasks_created']} tasks created",
        ),
    ]


def detail_rows(
    store: str, args: argparse.Namespace, tasks: str, seconds: str, extra: list[str], burn: dict[str, Any], step: Any
) -> tuple[list[tuple[str, str]], dict[str, dict[str, Any]]]:
    """Every row of a store after its burn-downs (TLS, resources, keyed rates, latency, the
    dashboard, fair share, a bulk retry, two shards), and its latency runs by batch size."""
    rows: list[tuple[str, str]] = []
    lat: dict[str, dict[str, Any]] = {}
    step(f"cronoq on {store}: burn-down over TLS with a bearer token")
    secure = run("burndown.py", "--tasks", tasks, "--secure", *extra)
    rows.append(
        (
            f"cronoq {store}: the same burn-down over TLS (both sides) with a token",
            f"{secure['drain_tasks_per_s']:,} tasks/s "
            f"({secure['drain_tasks_per_s'] / burn['drain_tasks_per_s']:.2f}× plain)",
        )
    )
    step(f"cronoq on {store}: burn-down with a concurrency resource (capacity 64) on every task")
    slots = run("burndown.py", "--tasks", tasks, "--resource-capacity", "64", *extra)
    rows.append(
        (
            f"cronoq {store}: the same burn-down, every task holding a slot of a resource of capacity 64",
            f"{slots['drain_tasks_per_s']:,} tasks/s "
            f"({slots['drain_tasks_per_s'] / burn['drain_tasks_per_s']:.2f}× without)",
        )
    )
    step(f"cronoq on {store}: 50 keys of a keyed rate resource, each limited to 20/s")
    keyed = run("keyed_rate.py", *extra)
    rows.append((f"cronoq {store}: 50 keys each limited to 20/s, starts per key over 10 s", keyed_rate_text(keyed)))
    keyed = run("keyed_rate.py", "--by-key", *extra)
    rows.append(
        (
            f"cronoq {store}: the same, every task of one key submitted before the next key's",
            keyed_rate_text(keyed),
        )
    )
    step(f"cronoq on {store}: a lease's cost over 50 to 10,000 keys of a keyed resource")
    cost = run("keyed_lease_cost.py", "--leases", "30" if args.quick else "100", *extra)
    rows.append((f"cronoq {store}: a lease over N keys of a keyed resource", keyed_lease_text(cost)))
    for batch in ("10", "1"):
        step(f"cronoq on {store}: latency, calls of {batch}")
        lat[batch] = run("latency.py", "--seconds", seconds, "--batch", batch, *extra)
        how = "100 calls/s of 10 tasks" if batch == "10" else "one SubmitTask per task"
        rows.append((f"cronoq {store}: submit→start at 1,000 tasks/s, {how}", latency_text(lat[batch])))
    step(f"cronoq on {store}: Watch delivery latency")
    watch = run("watch_latency.py", "--seconds", seconds, *extra)
    title = f"cronoq {store}: submit→Watch event at 500 tasks/s, one SubmitTask per task"
    rows.append((title, latency_text(watch)))
    title = f"cronoq {store}: the burn-down with a dashboard page open in headless Chromium"
    if not Path("/usr/bin/chromium").exists():
        rows.append((title, "skipped: no /usr/bin/chromium (apt-get install chromium)"))
    else:
        step(f"cronoq on {store}: the burn-down with a dashboard page open (none / overview / live)")
        rows.append(
            (
                title,
                dashboard_cost_text(
                    run("dashboard_cost.py", "--tasks", tasks, "--rounds", "1" if args.quick else "3", *extra)
                ),
            )
        )
    rows += fair_share_rows(store, args.quick, extra)
    step(f"cronoq on {store}: a workflow's fan-out of 10,000 children and a join")
    sizes = ["--children", "2000", "--rounds", "1"] if args.quick else ["--children", "10000", "--rounds", "3"]
    flow = run("workflow.py", *sizes, *extra)
    rows.append(
        (
            f"cronoq {store}: a handler spawns {flow['children']:,} children and a join (their sum), 1 worker process,"
            " concurrency 64: submit to the join's end",
            f"median {flow['median_s']} s of {flow['rounds']} ({flow['children_per_s']:,} children/s)",
        )
    )
    step(f"cronoq on {store}: a bulk retry of FAILED tasks while another caller works")
    bulk = run("bulk.py", "--tasks", "10000" if args.quick else "50000", *extra)
    rows.append((f"cronoq {store}: RetryTasks of {bulk['tasks']:,} FAILED tasks", bulk_text(bulk)))
    rows += history_rows(store, args.quick, extra, step)
    step(f"cronoq on {store}: two shards (forwarding, ListTasks across shards, burn-down across shards)")
    small = ["--calls", "300", "--rounds", "1"] if args.quick else []
    rows += sharding_rows(store, run("sharding.py", "--tasks", tasks, *small, *extra))
    return rows, lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="5,000 tasks and 3 s latency runs")
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument(
        "--throughput",
        action="store_true",
        help="the burn-downs only: cronoq's (concurrency 64 and 1000, each SDK's worker), PgQueuer's, River's; "
        "the submit path (bench/submit.py)",
    )
    args = ap.parse_args()
    tasks = "5000" if args.quick else "20000"
    seconds = "3" if args.quick else "5"
    rows: list[tuple[str, str]] = []
    ratios: list[tuple[str, str]] = []
    submit_batch: dict[str, int] = {}  # SubmitBatch tasks/s by store

    def step(title: str) -> None:
        print(f"== {title}", file=sys.stderr, flush=True)

    for store in ("sqlite", "postgres"):
        with bench_store(store, None) as url:
            extra = ["--store", store] + (["--url", url] if url else [])
            step(f"cronoq on {store}: burn-down")
            burn = run("burndown.py", "--tasks", tasks, *extra)
            rows.append(
                (
                    f"cronoq {store}: burn-down {tasks} no-op tasks, 1 worker process, concurrency 64",
                    f"{burn['drain_tasks_per_s']:,} tasks/s",
                )
            )
            step(f"cronoq on {store}: burn-down at concurrency {WIDE}")
            wide = run("burndown.py", "--tasks", tasks, "--concurrency", str(WIDE), *extra)
            rows.append(
                (
                    f"cronoq {store}: the same burn-down at concurrency {WIDE}",
                    f"{wide['drain_tasks_per_s']:,} tasks/s "
                    f"({wide['drain_tasks_per_s'] / burn['drain_tasks_per_s']:.2f}× concurrency 64); "
                    f"worker peak RSS {wide['worker_rss_mib']} MiB (at 64: {burn['worker_rss_mib']} MiB)",
                )
            )
            step(f"cronoq on {store}: burn-down at concurrency 64 with prefetch {PREFETCH}")
            pre = run("burndown.py", "--tasks", tasks, "--prefetch", str(PREFETCH), *extra)
            rows.append(
                (
                    f"cronoq {store}: the same burn-down at concurrency 64 with prefetch {PREFETCH}",
                    f"{pre['drain_tasks_per_s']:,} tasks/s "
                    f"(the default prefetch: {burn['drain_tasks_per_s'] / pre['drain_tasks_per_s']:.2f}× this)",
                )
            )
            rows.append(
                (
                    f"cronoq {store}: CPU µs per task during the burn-down, concurrency 64 / {WIDE}"
                    f" / 64 with prefetch {PREFETCH}",
                    f"{cpu_text(burn)} / {cpu_text(wide)} / {cpu_text(pre)}",
                )
            )
            for sdk, name, tool in (("go", "Go", "go"), ("ts", "TypeScript", "node"), ("rust", "Rust", "cargo")):
                title = f"cronoq {store}: the same burn-down with the {name} SDK's worker, concurrency 64 / {WIDE}"
                if not shutil.which(tool):
                    rows.append((title, f"skipped: no `{tool}` on PATH"))
                    continue
                step(f"cronoq on {store}: burn-down with the {name} SDK's worker (concurrency 64 and {WIDE})")
                other = run("burndown.py", "--tasks", tasks, "--worker", sdk, *extra)
                other_wide = run("burndown.py", "--tasks", tasks, "--worker", sdk, "--concurrency", str(WIDE), *extra)
                ratio = other["drain_tasks_per_s"] / burn["drain_tasks_per_s"]
                ratio_wide = other_wide["drain_tasks_per_s"] / wide["drain_tasks_per_s"]
                rows.append(
                    (
                        title,
                        f"{other['drain_tasks_per_s']:,} / {other_wide['drain_tasks_per_s']:,} tasks/s "
                        f"({ratio:.2f}× / {ratio_wide:.2f}× the Python worker)",
                    )
                )
            if args.throughput:
                with_river = store == "postgres" and not args.no_anchors
                step(f"cronoq on {store}: the submit path" + (", River's inserts beside it" if with_river else ""))
                quick = ["--quick"] if args.quick else []
                sub = run("submit.py", *quick, *([] if with_river else ["--no-river"]), *extra)
                more, more_ratios = submit_rows(store, sub)
                rows += more
                ratios += more_ratios
                submit_batch[store] = sub["batch"]["tasks_per_s"]
            lat: dict[str, dict[str, Any]] = {}
            if not args.throughput:
                more, lat = detail_rows(store, args, tasks, seconds, extra, burn, step)
                rows += more
            if store == "postgres" and url is not None:
                step("cronoq on postgres: the store's Work steps alone (no server, no worker)")
                alone = run("store_steps.py", "--tasks", tasks, "--url", url)
                rows.append(
                    (
                        "cronoq postgres: the store's Work steps alone, 32 tasks a step (no server, no worker)",
                        f"PostgreSQL {alone['postgres_cpu_us_per_task']} µs of CPU a task",
                    )
                )
            if store == "postgres" and url is not None and not args.throughput:
                rows_outbox, ratios_outbox = outbox_rows(url, args, step)
                rows += rows_outbox
                ratios += ratios_outbox
            if store == "postgres" and not args.no_anchors:
                import anchors  # the anchors' own virtualenv; never a product dependency

                assert url is not None  # bench_store("postgres") yields a server's URL

                # --throughput: PgQueuer's burn-down only (procrastinate's is far behind).
                for name in ["pgqueuer"] if args.throughput else anchors.SYSTEMS:
                    step(f"{name} on the same PostgreSQL: burn-down")
                    a_burn = anchors.run_anchor(name, "burndown", url, tasks=int(tasks))
                    rows.append(
                        (
                            f"{name}: burn-down {tasks} no-op jobs, 1 worker process",
                            f"{a_burn['drain_per_s']:,.0f} jobs/s",
                        )
                    )
                    ratios.append(
                        (f"cronoq / {name}, burn-down", f"{burn['drain_tasks_per_s'] / a_burn['drain_per_s']:.2f}×")
                    )
                    ratios.append(
                        (
                            f"cronoq with prefetch {PREFETCH} / {name}, burn-down",
                            f"{pre['drain_tasks_per_s'] / a_burn['drain_per_s']:.2f}×",
                        )
                    )
                    if args.throughput:
                        continue
                    step(f"{name} on the same PostgreSQL: latency")
                    a_lat = anchors.run_anchor(name, "latency", url, rate=1000, seconds=float(seconds), batch=10)
                    rows.append((f"{name}: submit→start at 1,000 jobs/s, 100 calls/s of 10 jobs", latency_text(a_lat)))
                    ratios.append(
                        (
                            f"{name} p50 / cronoq p50, latency (higher: cronoq faster)",
                            f"{a_lat['p50_ms'] / max(lat['10']['p50_ms'], 0.01):.2f}×",
                        )
                    )
                for title, max_workers in anchors.RIVER_RUNS:
                    step(f"River on the same PostgreSQL: burn-down, MaxWorkers {max_workers}")
                    try:
                        river = anchors.run_river(url, jobs=int(tasks), max_workers=max_workers)
                    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:  # e.g. go build, no modules
                        step(f"River failed: {exc}")
                        rows.append(("River: burn-down", f"failed: {str(exc)[-200:]}"))
                        break
                    if river is None:
                        step("River skipped: no `go` on PATH")
                        rows.append(("River: burn-down", "skipped (no `go` on PATH)"))
                        break
                    title = title.format(tasks=int(tasks))
                    rows.append((f"River {river['version']}: {title}", f"{river['jobs_per_s']:,.0f} jobs/s"))
                    if max_workers == 64:
                        title, ours = "cronoq / River, burn-down, both at concurrency 64", burn["drain_tasks_per_s"]
                        ratios.append((title, f"{ours / river['jobs_per_s']:.2f}×"))
                        title = f"cronoq / River, both at concurrency 64, cronoq with prefetch {PREFETCH}"
                        ours = pre["drain_tasks_per_s"]
                    else:  # each at its best: River's bench settings, cronoq's best of its three
                        ours = max(burn["drain_tasks_per_s"], wide["drain_tasks_per_s"], pre["drain_tasks_per_s"])
                        title = f"cronoq / River, burn-down, each at its best (River MaxWorkers {max_workers})"
                    ratios.append((title, f"{ours / river['jobs_per_s']:.2f}×"))
    if len(submit_batch) == 2:
        sqlite, postgres = submit_batch["sqlite"], submit_batch["postgres"]
        ratios.append(
            (
                "cronoq SubmitBatch of 1,000, SQLite / PostgreSQL",
                f"{sqlite:,} / {postgres:,} tasks/s = {sqlite / postgres:.2f}×",
            )
        )
    if not args.throughput:
        rows += contention_rows(args.quick, step)
    print("\n| run | result |\n|---|---|")
    for title, text in rows + ratios:
        print(f"| {title} | {text} |")


def outbox_rows(url: str, args: argparse.Namespace, step: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The outbox (bench/outbox.py): enqueue throughput and commit→start, River's InsertTx beside
    it unless --no-anchors; its rows and its ratios."""
    step("cronoq on postgres: the outbox (enqueue in the application's transactions, the relay), River's InsertTx")
    r = run(
        "outbox.py", "--url", url, *(["--quick"] if args.quick else []), *(["--no-river"] if args.no_anchors else [])
    )
    n, one, each, river = f"{r['tasks']:,}", r["one_tx"], r["each_tx"], r["river"]
    rows = [
        (
            f"cronoq postgres outbox: cronoq.outbox (asyncpg), one transaction of {n} tasks / {n} transactions of one,"
            " the relay running",
            f"{one['tasks_per_s']:,} / {each['tasks_per_s']:,} tasks/s; the outbox empty "
            f"{one['relayed_after_s']} s / {each['relayed_after_s']} s after the last commit",
        ),
        (
            f"cronoq postgres outbox: commit→start at {r['rate']}/s, a task a transaction, NOTIFY",
            latency_text(r["notify"]),
        ),
        (
            f"cronoq postgres outbox: the same, notify = false, poll_interval {r['poll_interval']}",
            latency_text(r["poll"]),
        ),
    ]
    if "skipped" in river:
        return [*rows, ("River: InsertTx in the application's transactions", river["skipped"])], []
    rows += [
        (
            f"River {river['version']}: InsertManyTx of {n} jobs in one transaction / {n} transactions of InsertTx",
            f"{river['one_tx_tasks_per_s']:,.0f} / {river['each_tx_tasks_per_s']:,.0f} jobs/s",
        ),
        (
            f"River {river['version']}: commit→start at {r['rate']}/s, a job a transaction, MaxWorkers 64"
            f" (FetchPollInterval {river['fetch_poll_ms']:g} ms)",
            latency_text(river["latency"]),
        ),
    ]
    q = r["ratios"]
    ratios = [
        (
            f"cronoq / River, enqueue in the application's transaction, one of {n} / {n} of one (target ≥ 0.5×)",
            f"{q['one_tx']:.2f}× / {q['each_tx']:.2f}×",
        ),
        (
            "cronoq / River, commit→start p50 / p99 with NOTIFY (≤ 1: cronoq faster; target p99 ≤ 50 ms)",
            f"{q['p50_notify']:.2f}× / {q['p99_notify']:.2f}×",
        ),
    ]
    return rows, ratios


def contention_rows(quick: bool, step: Any) -> list[tuple[str, str]]:
    """Single-SubmitTask latency on SQLite while the server carries idle load."""
    rows: list[tuple[str, str]] = []
    step("cronoq on sqlite: submit latency under idle load (long polls, stalled watchers, scrapes)")
    busy = run("contention.py", "--tasks", "50000" if quick else "300000")
    quiet = busy["quiet_p50_ms"]
    for title, key in (
        ("quiet", "quiet_p50_ms"),
        ("1,000 idle long polls", "idle_polls_p50_ms"),
        ("2 stalled watchers", "stalled_watchers_p50_ms"),
        (f"{busy['stored_tasks']:,} tasks stored", "stored_p50_ms"),
        (f"{busy['stored_tasks']:,} tasks stored, /metrics scraped 10/s", "scraped_p50_ms"),
    ):
        rows.append(
            (f"cronoq sqlite: single SubmitTask p50, {title}", f"{busy[key]} ms ({busy[key] / quiet:.2f}× quiet)")
        )
    return rows


if __name__ == "__main__":
    main()
