// The Go SDK's burn-down: N no-op tasks submitted in batches with the Go client, then
// drained by one Go worker. Prints one JSON line. Not run by ./dev bench (yet).
//
//	go -C bench/go-worker run . [-tasks 20000] [-concurrency 64] [-batch 500] [-endpoint URL]
//
// Without -endpoint it starts its own cronoq-server (from PATH, or -server) on SQLite in a
// temporary directory, as bench/burndown.py does; run it where ./dev installed the server,
// e.g. with PATH=.nox/bench/bin:$PATH.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cronoq/cronoq/sdk-go"
)

func main() {
	tasks := flag.Int("tasks", 20000, "tasks to submit and drain")
	concurrency := flag.Int("concurrency", 64, "the worker's concurrency")
	batch := flag.Int("batch", 500, "tasks per SubmitBatch")
	endpoint := flag.String("endpoint", "", "an existing server (its pool default must be empty); default: start one")
	server := flag.String("server", "cronoq-server", "the server command to start without -endpoint")
	flag.Parse()
	if err := run(*tasks, *concurrency, *batch, *endpoint, *server); err != nil {
		fmt.Fprintln(os.Stderr, "go-worker bench:", err)
		os.Exit(1)
	}
}

func run(total, concurrency, batch int, endpoint, server string) error {
	if endpoint == "" {
		stop, ep, err := startServer(server)
		if err != nil {
			return err
		}
		defer stop()
		endpoint = ep
	}
	ctx := context.Background()
	opts := cronoq.Options{Endpoint: endpoint, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	client, err := cronoq.NewClient(opts)
	if err != nil {
		return err
	}
	defer client.Close()
	submitStarted := time.Now()
	for i := 0; i < total; i += batch {
		specs := make([]cronoq.TaskSpec, min(batch, total-i))
		for j := range specs {
			specs[j] = cronoq.TaskSpec{Pool: "default"}
		}
		if _, err := client.SubmitBatch(ctx, specs); err != nil {
			return fmt.Errorf("submit: %w", err)
		}
	}
	submitted := time.Since(submitStarted)

	var handled atomic.Int64
	done := make(chan struct{})
	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{Options: opts, Pools: []string{"default"}, Concurrency: concurrency},
		func(context.Context, *cronoq.Task) (any, error) {
			if handled.Add(1) == int64(total) {
				close(done)
			}
			return nil, nil
		})
	if err != nil {
		return err
	}
	drainStarted := time.Now()
	runErr := make(chan error, 1)
	go func() { runErr <- worker.Run(ctx) }()
	select {
	case <-done:
	case err := <-runErr:
		return fmt.Errorf("the worker stopped after %d tasks: %v", handled.Load(), err)
	case <-time.After(10 * time.Minute):
		return fmt.Errorf("the worker handled %d of %d tasks in 10 minutes", handled.Load(), total)
	}
	drained := time.Since(drainStarted)
	worker.Stop()
	if err := <-runErr; err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"tasks":                 total,
		"concurrency":           concurrency,
		"submit_tasks_per_s":    int(float64(total) / submitted.Seconds()),
		"drain_tasks_per_s":     int(float64(total) / drained.Seconds()),
		"drain_seconds":         drained.Seconds(),
		"outcomes_acknowledged": worker.Processed(),
	})
}

// startServer starts a cronoq-server on SQLite in a temporary directory and waits until
// it leads; stop ends it and removes the directory.
func startServer(command string) (stop func(), endpoint string, err error) {
	dir, err := os.MkdirTemp("", "cronoq-go-bench-")
	if err != nil {
		return nil, "", err
	}
	grpcPort, httpPort := freePort(), freePort()
	config := filepath.Join(dir, "cronoq.toml")
	toml := fmt.Sprintf("[server]\nlisten = \"127.0.0.1:%d\"\nhttp_listen = \"127.0.0.1:%d\"\n[store]\npath = %q\n[[pools]]\nname = \"default\"\n",
		grpcPort, httpPort, filepath.Join(dir, "cronoq.db"))
	if err := os.WriteFile(config, []byte(toml), 0o600); err != nil {
		return nil, "", err
	}
	cmd := exec.Command(command, "--config", config)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, "", fmt.Errorf("starting %s: %w", command, err)
	}
	stop = func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
		_ = os.RemoveAll(dir)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/readyz", httpPort))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return stop, fmt.Sprintf("http://127.0.0.1:%d", grpcPort), nil
			}
		}
		if time.Now().After(deadline) {
			stop()
			return nil, "", fmt.Errorf("%s did not become ready in 15 s", command)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
