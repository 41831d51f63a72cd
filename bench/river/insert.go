package main

// --workload insert: River's submit path, bench/submit.py's workloads beside cronoq's. An
// insert-only client (no queues, never started). Throughput: --jobs no-op jobs with InsertMany
// in calls of --batch (after one untimed call of --batch), the client's CPU (getrusage) with it.
// Single inserts, open loop: for each rate of --rates, for --seconds, insert i is due at
// t0 + i/rate and is made by goroutine i % --clients with Client.Insert; its latency runs from
// its due time to its answer (a goroutine still waiting on its previous insert starts late and
// that lateness counts). The ramp stops after the first rate whose p99 exceeds --stop-p99.
// Every latency is returned (seconds): bench/submit.py computes the percentiles as for cronoq.

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

func runInsert(ctx context.Context, o options, driver *riverpgxv5.Driver) (map[string]any, error) {
	rates, err := parseRates(o.rates)
	if err != nil {
		return nil, err
	}
	client, err := river.NewClient(driver, &river.Config{Schema: o.schema})
	if err != nil {
		return nil, err
	}
	batch := make([]river.InsertManyParams, o.batch)
	for i := range batch {
		batch[i] = river.InsertManyParams{Args: NoopArgs{}}
	}
	if _, err := client.InsertMany(ctx, batch); err != nil { // warms the pool's connections
		return nil, fmt.Errorf("InsertMany: %w", err)
	}
	logf("InsertMany: %d jobs in calls of %d", o.jobs, o.batch)
	cpuStart := cpuSeconds()
	start := time.Now()
	for done := 0; done < o.jobs; done += o.batch {
		if _, err := client.InsertMany(ctx, batch[:min(o.batch, o.jobs-done)]); err != nil {
			return nil, fmt.Errorf("InsertMany: %w", err)
		}
	}
	batchS := time.Since(start).Seconds()
	cpuUs := (cpuSeconds() - cpuStart) / float64(o.jobs) * 1e6

	var ramp []map[string]any
	for _, rate := range rates {
		logf("Insert, open loop: %d/s for %gs from %d goroutines", rate, o.seconds, o.clients)
		latencies, achieved, failed, err := insertAtRate(ctx, client, rate, o.seconds, o.clients)
		if err != nil {
			return nil, err
		}
		ramp = append(ramp, map[string]any{
			"rate": rate, "achieved_rate": round(achieved), "failed": failed, "latencies": latencies,
		})
		if p99 := percentile(latencies, 99); p99 > o.stopP99.Seconds() {
			logf("p99 %.1f ms at %d/s: the ramp stops", p99*1000, rate)
			break
		}
	}
	return map[string]any{
		"system":              "river",
		"version":             riverVersion(),
		"jobs":                o.jobs,
		"batch":               o.batch,
		"batch_jobs_per_s":    round(float64(o.jobs) / batchS),
		"batch_client_cpu_us": round2(cpuUs),
		"clients":             o.clients,
		"seconds":             o.seconds,
		"max_conns":           o.maxConns,
		"single":              ramp,
	}, nil
}

// insertAtRate makes rate*seconds single inserts, open loop; their latencies from their due
// times (seconds), the rate answered (inserts / from t0 to the last answer), and the failures.
func insertAtRate(
	ctx context.Context, client *river.Client[pgx.Tx], rate int, seconds float64, clients int,
) ([]float64, float64, int, error) {
	total := int(float64(rate) * seconds)
	latencies := make([]float64, total) // each goroutine writes its own indexes
	failures := make([]int, clients)
	var firstErr error
	var errOnce sync.Once
	var wg sync.WaitGroup
	t0 := time.Now().Add(50 * time.Millisecond) // every goroutine is waiting when the first is due
	for g := 0; g < clients; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := g; i < total; i += clients {
				due := t0.Add(time.Duration(float64(i) / float64(rate) * float64(time.Second)))
				if wait := time.Until(due); wait > 0 {
					time.Sleep(wait)
				}
				if _, err := client.Insert(ctx, NoopArgs{}, nil); err != nil {
					failures[g]++
					errOnce.Do(func() { firstErr = err })
				}
				latencies[i] = time.Since(due).Seconds()
			}
		}(g)
	}
	wg.Wait()
	elapsed := time.Since(t0).Seconds()
	if ctx.Err() != nil {
		return nil, 0, 0, ctx.Err()
	}
	failed := 0
	for _, n := range failures {
		failed += n
	}
	if failed > 0 {
		logf("%d inserts failed at %d/s, e.g. %v", failed, rate, firstErr)
	}
	return latencies, float64(total) / elapsed, failed, nil
}

func parseRates(text string) ([]int, error) {
	var rates []int
	for _, field := range strings.Split(text, ",") {
		rate, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil || rate <= 0 {
			return nil, fmt.Errorf("--rates: %q is not a positive integer", field)
		}
		rates = append(rates, rate)
	}
	return rates, nil
}

func percentile(values []float64, p float64) float64 {
	s := append([]float64(nil), values...)
	sort.Float64s(s)
	return s[min(int(float64(len(s))*p/100), len(s)-1)]
}

// cpuSeconds is this process's user + system CPU time.
func cpuSeconds() float64 {
	var usage syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &usage); err != nil {
		fmt.Fprintln(os.Stderr, "getrusage:", err)
		return 0
	}
	return time.Duration(usage.Utime.Nano() + usage.Stime.Nano()).Seconds()
}
