// River anchor of cronoq's bench: the burn-down workload (N no-op jobs inserted in
// batches, then drained by one client) run with River (https://riverqueue.com) on the
// same PostgreSQL server as cronoq's bench, with --workload outbox the jobs inserted
// in the application's own transactions (outbox.go, for bench/outbox.py), and with
// --workload insert River's submit path (insert.go, for bench/submit.py). Built and run by
// bench/anchors.py; never part of cronoq.
//
//	go build -o river-bench . && ./river-bench --url postgres://... --jobs 20000 --max-workers 64
//
// Every run creates its own database on the server (dropped afterwards unless
// --keep-db) and installs River's tables in --schema there with River's own
// migrations (rivermigrate; River's CLI module is not needed). The jobs are inserted
// with Client.InsertMany in batches of --batch before the client starts; then one
// client with MaxWorkers --max-workers works them, and the drain is timed from
// Client.Start until the completion subscription has reported every job (a job
// counts once River's completer has marked it completed in PostgreSQL). The fetch
// settings default to those of River's own benchmark (`river bench`: FetchCooldown
// 2 ms, FetchPollInterval 20 ms); River's defaults (100 ms, 1 s) cap a 64-worker
// client near 640 jobs/s. One JSON line on stdout; progress on stderr.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/riverqueue/river/rivertype"
)

// NoopArgs is the job: no payload, nothing to do.
type NoopArgs struct{}

func (NoopArgs) Kind() string { return "noop" }

type NoopWorker struct {
	river.WorkerDefaults[NoopArgs]
	started *atomic.Int64
	lastAt  *atomic.Int64 // unix nanoseconds of the latest Work call
}

func (w *NoopWorker) Work(ctx context.Context, job *river.Job[NoopArgs]) error {
	w.started.Add(1)
	w.lastAt.Store(time.Now().UnixNano())
	return nil
}

type options struct {
	url               string
	jobs              int
	maxWorkers        int
	schema            string
	batch             int
	fetchCooldown     time.Duration
	fetchPollInterval time.Duration
	keepDB            bool
	timeout           time.Duration
	workload          string
	rate              int
	seconds           float64
	rounds            int
	rates             string
	clients           int
	stopP99           time.Duration
	maxConns          int
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[river] "+format+"\n", args...)
}

func main() {
	var o options
	flag.StringVar(&o.url, "url", "", "PostgreSQL server URL (required); the run creates its own database there")
	flag.IntVar(&o.jobs, "jobs", 20_000, "jobs to insert and drain")
	flag.IntVar(&o.maxWorkers, "max-workers", 64, "MaxWorkers of the client's one queue")
	flag.StringVar(&o.schema, "schema", "river_bench", "schema of River's tables in the run's database")
	flag.IntVar(&o.batch, "batch", 500, "jobs per InsertMany call")
	flag.DurationVar(&o.fetchCooldown, "fetch-cooldown", 2*time.Millisecond, "Config.FetchCooldown (River's default: 100ms)")
	flag.DurationVar(&o.fetchPollInterval, "fetch-poll-interval", 20*time.Millisecond, "Config.FetchPollInterval (River's default: 1s)")
	flag.BoolVar(&o.keepDB, "keep-db", false, "do not drop the run's database afterwards")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Minute, "deadline of the whole run")
	flag.StringVar(&o.workload, "workload", "burndown", "burndown, outbox (bench/outbox.py's: InsertTx/InsertManyTx in pgx transactions, commit→start) or insert (bench/submit.py's: InsertMany, single Inserts open loop)")
	flag.IntVar(&o.rate, "rate", 50, "outbox: transactions of one job per second in the commit→start run")
	flag.Float64Var(&o.seconds, "seconds", 10, "outbox: seconds of the commit→start run; insert: of each rate")
	flag.IntVar(&o.rounds, "rounds", 3, "outbox: rounds of each insert workload (the median is reported)")
	flag.StringVar(&o.rates, "rates", "500,1000,2000,3000,4000", "insert: rates (inserts/s) of the single-insert runs, in order")
	flag.IntVar(&o.clients, "clients", 64, "insert: goroutines making the single inserts")
	flag.DurationVar(&o.stopP99, "stop-p99", 200*time.Millisecond, "insert: the ramp stops after the first rate whose p99 exceeds this")
	flag.IntVar(&o.maxConns, "max-conns", 0, "the pgx pool's MaxConns (0: pgxpool's default, max(4, CPUs))")
	flag.Parse()
	if o.workload != "burndown" && o.workload != "outbox" && o.workload != "insert" {
		flag.Usage()
		os.Exit(2)
	}
	if o.url == "" || o.jobs <= 0 || o.maxWorkers <= 0 || o.batch <= 0 || o.rate <= 0 || o.rounds <= 0 || o.clients <= 0 || o.maxConns < 0 {
		flag.Usage()
		os.Exit(2)
	}
	// A TERM or an interrupt (bench/anchors.py's timeout) cancels ctx: the run stops its
	// client and drops its database on the way out.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	result, err := run(ctx, o)
	cancel()
	stop()
	if err != nil {
		logf("error: %v", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(result)
	fmt.Println(string(out))
}

func run(ctx context.Context, o options) (map[string]any, error) {
	dbName := fmt.Sprintf("anchor_river_%s_%d_%d", o.workload, os.Getpid(), time.Now().UnixNano()%1_000_000)
	dbURL, err := withDatabase(o.url, dbName)
	if err != nil {
		return nil, err
	}
	if err := admin(ctx, o.url, fmt.Sprintf(`CREATE DATABASE "%s"`, dbName)); err != nil {
		return nil, fmt.Errorf("creating database: %w", err)
	}
	logf("database %s, schema %s", dbName, o.schema)
	if !o.keepDB {
		defer func() {
			// Not ctx: the database goes even when the run was interrupted.
			dropCtx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			if err := admin(dropCtx, o.url, fmt.Sprintf(`DROP DATABASE IF EXISTS "%s" WITH (FORCE)`, dbName)); err != nil {
				logf("could not drop %s: %v", dbName, err)
			}
		}()
	}
	pool, driver, err := setUp(ctx, o, dbURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if o.workload == "outbox" {
		return runOutbox(ctx, o, pool, driver)
	}
	if o.workload == "insert" {
		return runInsert(ctx, o, driver)
	}

	var started, lastWorkAt atomic.Int64
	workers := river.NewWorkers()
	river.AddWorker(workers, &NoopWorker{started: &started, lastAt: &lastWorkAt})
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

	logf("inserting %d no-op jobs with InsertMany in batches of %d", o.jobs, o.batch)
	insertStart := time.Now()
	params := make([]river.InsertManyParams, 0, o.batch)
	for done := 0; done < o.jobs; {
		params = params[:0]
		for i := 0; i < o.batch && done+i < o.jobs; i++ {
			params = append(params, river.InsertManyParams{Args: NoopArgs{}})
		}
		if _, err := client.InsertMany(ctx, params); err != nil {
			return nil, fmt.Errorf("InsertMany: %w", err)
		}
		done += len(params)
	}
	insertS := time.Since(insertStart).Seconds()

	// Every completion arrives on this channel; it is large enough to never drop one.
	events, unsubscribe := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: o.jobs + 1000,
		Kinds:    []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled},
	})
	defer unsubscribe()

	logf("starting one client, MaxWorkers %d, FetchCooldown %s, FetchPollInterval %s",
		o.maxWorkers, o.fetchCooldown, o.fetchPollInterval)
	drainStart := time.Now()
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
	completed, failed := 0, 0
	report := max(o.jobs/10, 1)
	for completed+failed < o.jobs {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w after %d/%d jobs completed", ctx.Err(), completed, o.jobs)
		case ev := <-events:
			if ev == nil {
				return nil, errors.New("subscription closed")
			}
			if ev.Kind == river.EventKindJobCompleted {
				completed++
			} else if ev.Kind == river.EventKindJobCancelled || ev.Job.State == rivertype.JobStateDiscarded {
				failed++ // does not happen with a no-op worker; counted so that the run ends
			}
			if (completed+failed)%report == 0 {
				fmt.Fprintf(os.Stderr, "\r[river] completed %d/%d", completed, o.jobs)
			}
		}
	}
	drainS := time.Since(drainStart).Seconds()
	workedS := float64(lastWorkAt.Load()-drainStart.UnixNano()) / 1e9
	fmt.Fprintln(os.Stderr)
	if failed > 0 {
		return nil, fmt.Errorf("%d jobs failed or were cancelled", failed)
	}

	var inDB int64
	query := fmt.Sprintf(`SELECT count(*) FROM "%s".river_job WHERE state = 'completed'`, o.schema)
	if err := pool.QueryRow(ctx, query).Scan(&inDB); err != nil {
		return nil, fmt.Errorf("counting completed jobs: %w", err)
	}
	logf("drained %d jobs in %.2f s = %.0f jobs/s (%d completed in the database)",
		o.jobs, drainS, float64(o.jobs)/drainS, inDB)
	return map[string]any{
		"system":              "river",
		"version":             riverVersion(),
		"jobs":                o.jobs,
		"max_workers":         o.maxWorkers,
		"fetch_cooldown_ms":   o.fetchCooldown.Seconds() * 1000,
		"fetch_poll_ms":       o.fetchPollInterval.Seconds() * 1000,
		"insert_per_s":        round(float64(o.jobs) / insertS),
		"jobs_per_s":          round(float64(o.jobs) / drainS),
		"seconds":             round2(drainS),
		"last_work_seconds":   round2(workedS),
		"started":             started.Load(),
		"completed_in_db":     inDB,
		"completed_in_events": completed,
	}, nil
}

// admin runs one statement on the server's own database (CREATE/DROP DATABASE).
func admin(ctx context.Context, serverURL, sql string) error {
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

func withDatabase(serverURL, dbName string) (string, error) {
	u, err := url.Parse(serverURL)
	if err != nil {
		return "", fmt.Errorf("--url: %w", err)
	}
	u.Path = "/" + dbName
	return u.String(), nil
}

func riverVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == "github.com/riverqueue/river" {
				return strings.TrimPrefix(dep.Version, "v")
			}
		}
	}
	return "unknown"
}

func round(x float64) float64  { return float64(int64(x + 0.5)) }
func round2(x float64) float64 { return float64(int64(x*100+0.5)) / 100 }

// setUp connects to the run's database and installs River's tables in o.schema there.
func setUp(ctx context.Context, o options, dbURL string) (_ *pgxpool.Pool, _ *riverpgxv5.Driver, err error) {
	config, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, nil, err
	}
	if o.maxConns > 0 {
		config.MaxConns = int32(o.maxConns)
	}
	pool, err := pgxpool.NewWithConfig(ctx, config)
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			pool.Close()
		}
	}()
	if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE SCHEMA "%s"`, o.schema)); err != nil {
		return nil, nil, fmt.Errorf("creating schema: %w", err)
	}
	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, &rivermigrate.Config{
		Schema: o.schema,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return nil, nil, err
	}
	migrated, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("migrating: %w", err)
	}
	logf("migrated up (%d migrations)", len(migrated.Versions))
	return pool, driver, nil
}
