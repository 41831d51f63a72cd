// The Go SDK's side of the burn-down: one Go worker drains N no-op tasks that
// bench/burndown.py --worker go submitted, and prints one JSON line. Timed from the
// worker's start to the last task's start, as the Python worker and the anchors time it.
//
//	go -C bench/go-worker build -o go-worker . && bench/go-worker/go-worker -endpoint URL [-tasks 20000] [-concurrency 64] [-prefetch N]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/cronoq/cronoq/sdk-go"
)

func main() {
	endpoint := flag.String("endpoint", "", "the server whose pool default holds the tasks (required)")
	tasks := flag.Int("tasks", 20000, "tasks to drain")
	concurrency := flag.Int("concurrency", 64, "the worker's concurrency")
	prefetch := flag.Int("prefetch", -1, "the tasks the worker holds beyond its concurrency (-1: the SDK's default)")
	flag.Parse()
	if err := drain(*endpoint, *tasks, *concurrency, *prefetch); err != nil {
		fmt.Fprintln(os.Stderr, "go-worker bench:", err)
		os.Exit(1)
	}
}

func drain(endpoint string, total, concurrency, prefetch int) error {
	if endpoint == "" {
		return errors.New("-endpoint is required")
	}
	opts := cronoq.Options{Endpoint: endpoint, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	switch prefetch {
	case -1:
		prefetch = 0 // WorkerOptions' default
	case 0:
		prefetch = cronoq.NoPrefetch
	}
	var handled atomic.Int64
	done := make(chan struct{})
	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{Options: opts, Pools: []string{"default"}, Concurrency: concurrency, Prefetch: prefetch},
		func(context.Context, *cronoq.Task) (any, error) {
			if handled.Add(1) == int64(total) {
				close(done)
			}
			return nil, nil
		})
	if err != nil {
		return err
	}
	started := time.Now()
	runErr := make(chan error, 1)
	go func() { runErr <- worker.Run(context.Background()) }()
	select {
	case <-done:
	case err := <-runErr:
		return fmt.Errorf("the worker stopped after %d tasks: %v", handled.Load(), err)
	case <-time.After(10 * time.Minute):
		return fmt.Errorf("the worker handled %d of %d tasks in 10 minutes", handled.Load(), total)
	}
	drained := time.Since(started)
	worker.Stop()
	if err := <-runErr; err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{"tasks": total, "drain_s": drained.Seconds()})
}
