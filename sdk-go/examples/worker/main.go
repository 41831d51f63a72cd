// A Go worker and client against a cronoq server: it submits a few tasks to a pool, runs a
// worker for them, waits for each and prints how it ended; Ctrl-C stops it gracefully.
//
//	go run ./examples/worker -endpoint http://127.0.0.1:7070 -pool default
//
// The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/cronoq/cronoq/sdk-go"
)

type job struct {
	Kind string `json:"kind"`
	N    int    `json:"n"`
}

// handle doubles n; "broken" fails for good, "flaky" fails its first two attempts.
func handle(ctx context.Context, task *cronoq.Task) (any, error) {
	var in job
	if err := cronoq.DecodePayload(task, &in); err != nil {
		return nil, cronoq.NonRetryable(err)
	}
	switch {
	case in.Kind == "broken":
		return nil, cronoq.NonRetryable(errors.New("broken input: will not retry"))
	case in.Kind == "flaky" && task.GetAttempt() < 3:
		return nil, cronoq.RetryAfter(fmt.Errorf("flaky failure on attempt %d", task.GetAttempt()), 200*time.Millisecond)
	}
	select {
	case <-time.After(50 * time.Millisecond): // some work
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	return map[string]int{"doubled": in.N * 2}, nil
}

func main() {
	endpoint := flag.String("endpoint", envOr("CRONOQ_ENDPOINT", cronoq.DefaultEndpoint), "the server (several: comma-separated)")
	pool := flag.String("pool", "default", "the pool to submit to and work on")
	flag.Parse()
	if err := run(*endpoint, *pool); err != nil {
		fmt.Fprintln(os.Stderr, "example:", err)
		os.Exit(1)
	}
}

func run(endpoint, pool string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	opts := cronoq.Options{Endpoint: endpoint, Token: os.Getenv("CRONOQ_TOKEN"), Logger: slog.Default()}

	client, err := cronoq.NewClient(opts)
	if err != nil {
		return err
	}
	defer client.Close()
	var ids []uint64
	for _, j := range []job{{"double", 21}, {"flaky", 4}, {"broken", 0}} {
		sub, err := client.Submit(ctx, cronoq.TaskSpec{Pool: pool, Payload: j, MaxAttempts: 5})
		if err != nil {
			return fmt.Errorf("submit: %w", err)
		}
		fmt.Printf("submitted task %d (%s)\n", sub.Task.GetId(), j.Kind)
		ids = append(ids, sub.Task.GetId())
	}

	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{Options: opts, Pools: []string{pool}, Concurrency: 8}, handle)
	if err != nil {
		return err
	}
	workerCtx, stopWorker := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- worker.Run(workerCtx) }()

	for _, id := range ids {
		waited, err := client.Wait(ctx, cronoq.ByID(id), 30*time.Second)
		if err != nil {
			stopWorker()
			return fmt.Errorf("wait for task %d: %w", id, err)
		}
		task := waited.Task
		switch task.GetState() {
		case cronoq.TaskStateSucceeded:
			fmt.Printf("task %d: SUCCEEDED after %d attempt(s): %s\n", id, task.GetAttempt(), task.GetResult())
		default:
			fmt.Printf("task %d: %s after %d attempt(s): %s\n", id, strings.TrimPrefix(task.GetState().String(), "TASK_STATE_"), task.GetAttempt(), task.GetError())
		}
	}
	stopWorker() // a graceful stop: running tasks finish, the others are given back
	return <-done
}

func envOr(key, fallback string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return fallback
}
