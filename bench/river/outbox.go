package main

// --workload outbox: River's in-transaction insert, the workloads of bench/outbox.py (cronoq's
// transactional enqueue). Throughput: one pgx transaction of --jobs jobs (InsertManyTx) and
// --jobs transactions of one (InsertTx), each timed from Begin to the last Commit, with no
// client working (River has no relay: a committed job is ready). Commit → start: a started
// client (MaxWorkers --max-workers) works jobs that one transaction at a time inserts at
// --rate per second for --seconds, each carrying the time taken just before its insert and
// commit (sent back to back); the worker records when each job started.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

// CommitArgs is a job whose payload is the unix time (seconds) of its transaction's insert.
type CommitArgs struct {
	T float64 `json:"t"`
}

func (CommitArgs) Kind() string { return "commit_time" }

type CommitWorker struct {
	river.WorkerDefaults[CommitArgs]
	mu        sync.Mutex
	latencies []float64
	all       chan struct{}
	want      int
}

func (w *CommitWorker) Work(ctx context.Context, job *river.Job[CommitArgs]) error {
	now := float64(time.Now().UnixNano()) / 1e9
	w.mu.Lock()
	defer w.mu.Unlock()
	if job.Args.T == 0 { // a throughput job left over: not timed
		return nil
	}
	w.latencies = append(w.latencies, now-job.Args.T)
	if len(w.latencies) == w.want {
		close(w.all)
	}
	return nil
}

func unixNow() float64 { return float64(time.Now().UnixNano()) / 1e9 }

func runOutbox(ctx context.Context, o options, pool *pgxpool.Pool, driver *riverpgxv5.Driver) (map[string]any, error) {
	want := int(float64(o.rate) * o.seconds)
	worker := &CommitWorker{all: make(chan struct{}), want: want}
	workers := river.NewWorkers()
	river.AddWorker(workers, worker)
	client, err := river.NewClient(driver, &river.Config{
		FetchCooldown:     o.fetchCooldown,
		FetchPollInterval: o.fetchPollInterval,
		Logger:            slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: o.maxWorkers}},
		Schema:            o.schema,
		Workers:           workers,
	})
	if err != nil {
		return nil, err
	}
	inTx := func(insert func(tx pgx.Tx) error) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck // a no-op after Commit
		if err := insert(tx); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	truncate := func() error {
		_, err := pool.Exec(ctx, fmt.Sprintf(`TRUNCATE "%s".river_job`, o.schema))
		return err
	}

	oneTx, eachTx := make([]float64, 0, o.rounds), make([]float64, 0, o.rounds)
	for round := 0; round < o.rounds; round++ {
		logf("round %d: one transaction of %d jobs (InsertManyTx)", round+1, o.jobs)
		params := make([]river.InsertManyParams, o.jobs)
		for i := range params {
			params[i] = river.InsertManyParams{Args: CommitArgs{}}
		}
		start := time.Now()
		if err := inTx(func(tx pgx.Tx) error { _, err := client.InsertManyTx(ctx, tx, params); return err }); err != nil {
			return nil, fmt.Errorf("InsertManyTx: %w", err)
		}
		oneTx = append(oneTx, float64(o.jobs)/time.Since(start).Seconds())
		logf("round %d: %d transactions of one job (InsertTx)", round+1, o.jobs)
		start = time.Now()
		for i := 0; i < o.jobs; i++ {
			if err := inTx(func(tx pgx.Tx) error { _, err := client.InsertTx(ctx, tx, CommitArgs{}, nil); return err }); err != nil {
				return nil, fmt.Errorf("InsertTx: %w", err)
			}
		}
		eachTx = append(eachTx, float64(o.jobs)/time.Since(start).Seconds())
		if err := truncate(); err != nil {
			return nil, err
		}
	}

	logf("commit → start: one client, MaxWorkers %d, FetchCooldown %s, FetchPollInterval %s; %d/s for %gs",
		o.maxWorkers, o.fetchCooldown, o.fetchPollInterval, o.rate, o.seconds)
	if err := client.Start(ctx); err != nil {
		return nil, fmt.Errorf("starting client: %w", err)
	}
	defer func() {
		stopCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := client.Stop(stopCtx); err != nil {
			logf("stopping client: %v", err)
		}
	}()
	time.Sleep(time.Second) // as bench/outbox.py: the client starts fetching and listening
	start := time.Now()
	for i := 0; i < want; i++ {
		if delay := time.Until(start.Add(time.Duration(float64(i) / float64(o.rate) * float64(time.Second)))); delay > 0 {
			time.Sleep(delay)
		}
		insert := func(tx pgx.Tx) error { _, err := client.InsertTx(ctx, tx, CommitArgs{T: unixNow()}, nil); return err }
		if err := inTx(insert); err != nil {
			return nil, fmt.Errorf("InsertTx: %w", err)
		}
	}
	achieved := float64(want) / time.Since(start).Seconds()
	select {
	case <-worker.all:
	case <-time.After(60 * time.Second):
		return nil, fmt.Errorf("only %d/%d jobs started within 60 s of the last commit", len(worker.latencies), want)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	worker.mu.Lock()
	latencies := append([]float64(nil), worker.latencies...)
	worker.mu.Unlock()
	return map[string]any{
		"system":              "river",
		"version":             riverVersion(),
		"jobs":                o.jobs,
		"rounds":              o.rounds,
		"one_tx_tasks_per_s":  round(median(oneTx)),
		"each_tx_tasks_per_s": round(median(eachTx)),
		"max_workers":         o.maxWorkers,
		"fetch_cooldown_ms":   o.fetchCooldown.Seconds() * 1000,
		"fetch_poll_ms":       o.fetchPollInterval.Seconds() * 1000,
		"rate":                o.rate,
		"achieved_rate":       round(achieved),
		"latencies":           latencies,
	}, nil
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}
