// The conformance driver of the Go SDK: one case's input as JSON on stdin, one result as
// JSON on stdout (the protocol: conformance/README.md in the cronoq repository). It uses
// the SDK's public API only.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cronoq/cronoq/sdk-go"
)

func main() {
	os.Exit(run(os.Stdin, os.Stdout, os.Stderr))
}

type input struct {
	Case      string   `json:"case"`
	Endpoints []string `json:"endpoints"`
	Token     *string  `json:"token"`
	TLS       *struct {
		CA   string `json:"ca"`
		Cert string `json:"cert"`
		Key  string `json:"key"`
	} `json:"tls"`
	InsecureRedirectHTTP bool `json:"insecure_redirect_http"`
	Retry                struct {
		InitialBackoffMs int64  `json:"initial_backoff_ms"`
		MaxBackoffMs     int64  `json:"max_backoff_ms"`
		MaxElapsedMs     *int64 `json:"max_elapsed_ms"`
	} `json:"retry"`
	TimeoutMs int64 `json:"timeout_ms"`
	Keepalive *struct {
		TimeMs    int64 `json:"time_ms"`
		TimeoutMs int64 `json:"timeout_ms"`
	} `json:"keepalive"`
	Steps []step `json:"steps"`
}

type step struct {
	Op               string          `json:"op"`
	Pool             string          `json:"pool"`
	Payload          json.RawMessage `json:"payload"`
	ID               string          `json:"id"`
	TimeoutMs        int64           `json:"timeout_ms"`
	Pools            []string        `json:"pools"`
	Concurrency      int             `json:"concurrency"`
	UntilHandled     int             `json:"until_handled"`
	StopAfterStarted int             `json:"stop_after_started"`
	ShutdownGraceMs  *int64          `json:"shutdown_grace_ms"`
}

type result map[string]any

func run(stdin io.Reader, stdout, stderr io.Writer) int {
	var in input
	if err := json.NewDecoder(stdin).Decode(&in); err != nil {
		fmt.Fprintf(stderr, "conformance-driver: reading the case: %v\n", err)
		return 2
	}
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	opts := options(&in, logger)
	var results []result
	client, err := cronoq.NewClient(opts)
	for _, s := range in.Steps {
		var r result
		switch {
		case s.Op == "worker":
			r = runWorker(&in, s, opts)
		case err != nil:
			r = result{"error": errorOf(err)}
		default:
			r = clientStep(client, &in, s)
		}
		r["op"] = s.Op
		results = append(results, r)
	}
	if client != nil {
		_ = client.Close()
	}
	if err := json.NewEncoder(stdout).Encode(map[string]any{"steps": results}); err != nil {
		fmt.Fprintf(stderr, "conformance-driver: writing the result: %v\n", err)
		return 1
	}
	return 0
}

func ms(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

func options(in *input, logger *slog.Logger) cronoq.Options {
	opts := cronoq.Options{
		Endpoint:             strings.Join(in.Endpoints, ","),
		InsecureRedirectHTTP: in.InsecureRedirectHTTP,
		Timeout:              ms(in.TimeoutMs),
		Logger:               logger,
		Retry: cronoq.RetryConfig{
			InitialBackoff: ms(in.Retry.InitialBackoffMs),
			MaxBackoff:     ms(in.Retry.MaxBackoffMs),
			MaxElapsed:     -1, // null: no bound
		},
	}
	if in.Retry.MaxElapsedMs != nil {
		opts.Retry.MaxElapsed = ms(*in.Retry.MaxElapsedMs)
	}
	if in.Keepalive != nil {
		opts.Keepalive = cronoq.KeepaliveConfig{Time: ms(in.Keepalive.TimeMs), Timeout: ms(in.Keepalive.TimeoutMs)}
	}
	if in.Token != nil {
		opts.Token = *in.Token
	}
	if in.TLS != nil {
		opts.TLS = &cronoq.TLSConfig{CAFile: in.TLS.CA, CertFile: in.TLS.Cert, KeyFile: in.TLS.Key}
	}
	return opts
}

// errorOf is the protocol's form of an error.
func errorOf(err error) result {
	var e *cronoq.Error
	if !errors.As(err, &e) {
		return result{"code": "", "kind": "other", "message": err.Error()}
	}
	kind := ""
	switch {
	case errors.Is(err, cronoq.ErrTooManyRedirects):
		kind = "too_many_redirects"
	case errors.Is(err, cronoq.ErrRedirectRefused):
		kind = "redirect_refused"
	case errors.Is(err, cronoq.ErrTLS):
		kind = "tls"
	}
	return result{
		"code":           cronoq.CodeName(e.Code),
		"kind":           kind,
		"message":        e.Message,
		"shard":          e.Shard,
		"shard_endpoint": e.ShardEndpoint,
		"leader":         e.Leader,
		"reason":         e.Reason,
	}
}

func clientStep(client *cronoq.Client, in *input, s step) result {
	ctx := context.Background()
	if s.Op == "submit" {
		sub, err := client.Submit(ctx, cronoq.TaskSpec{Pool: s.Pool, Payload: s.Payload})
		if err != nil {
			return result{"error": errorOf(err)}
		}
		return result{"id": strconv.FormatUint(sub.Task.GetId(), 10), "error": nil}
	}
	id, err := strconv.ParseUint(s.ID, 10, 64)
	if err != nil {
		return result{"error": result{"code": "", "kind": "other", "message": fmt.Sprintf("id %q: %v", s.ID, err)}}
	}
	var task *cronoq.Task
	switch s.Op {
	case "get":
		task, err = client.Get(ctx, cronoq.ByID(id))
	case "cancel":
		task, err = client.Cancel(ctx, cronoq.ByID(id))
	case "wait":
		timeout := int64(10000)
		if s.TimeoutMs > 0 {
			timeout = s.TimeoutMs
		}
		var waited *cronoq.Waited
		if waited, err = client.Wait(ctx, cronoq.ByID(id), ms(timeout)); err == nil {
			task = waited.Task
		}
	default:
		return result{"error": result{"code": "", "kind": "unsupported", "message": fmt.Sprintf("unknown op %q", s.Op)}}
	}
	if err != nil {
		return result{"error": errorOf(err)}
	}
	return result{"id": strconv.FormatUint(task.GetId(), 10), "state": task.GetState().String(), "error": nil}
}

// runWorker runs a worker until it has handled until_handled tasks (or started
// stop_after_started), then stops it gracefully; or until it fails.
func runWorker(in *input, s step, opts cronoq.Options) result {
	var (
		mu       sync.Mutex
		started  = []string{}
		handled  = []result{}
		running  int
		most     int
		enough   = make(chan struct{})
		doneOnce sync.Once
	)
	signal := func() { doneOnce.Do(func() { close(enough) }) }
	handler := func(ctx context.Context, task *cronoq.Task) (any, error) {
		id := strconv.FormatUint(task.GetId(), 10)
		var payload map[string]any
		var raw any
		_ = cronoq.DecodePayload(task, &raw)
		payload, _ = raw.(map[string]any)
		mu.Lock()
		started = append(started, id)
		running++
		most = max(most, running)
		if len(started) == s.StopAfterStarted {
			signal()
		}
		mu.Unlock()
		end := "cancelled"
		defer func() {
			mu.Lock()
			running--
			handled = append(handled, result{"id": id, "attempt": task.GetAttempt(), "payload": raw, "end": end})
			if len(handled) == s.UntilHandled {
				signal()
			}
			mu.Unlock()
		}()
		if n, ok := payload["sleep_ms"].(float64); ok && n > 0 {
			select {
			case <-time.After(ms(int64(n))):
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}
		if msg, ok := payload["fail"]; ok {
			end = "raised"
			err := errors.New(fmt.Sprint(msg))
			if retryable, ok := payload["retryable"].(bool); ok && !retryable {
				return nil, cronoq.NonRetryable(err)
			}
			return nil, err
		}
		end = "returned"
		return payload["result"], nil
	}
	concurrency := 4
	if s.Concurrency > 0 {
		concurrency = s.Concurrency
	}
	grace := int64(5000)
	if s.ShutdownGraceMs != nil {
		grace = *s.ShutdownGraceMs
	}
	timeout := int64(15000)
	if s.TimeoutMs > 0 {
		timeout = s.TimeoutMs
	}
	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{
		Options:       opts,
		Pools:         s.Pools,
		Concurrency:   concurrency,
		ShutdownGrace: ms(grace),
	}, handler)
	if err != nil {
		return result{"started": started, "handled": handled, "max_running": 0, "endpoint": "", "error": errorOf(err)}
	}
	runErr := make(chan error, 1)
	go func() { runErr <- worker.Run(context.Background()) }()
	var failure result
	var finished bool
	select {
	case <-enough:
	case err := <-runErr:
		finished = true
		if err != nil {
			failure = errorOf(err)
		}
	case <-time.After(ms(timeout)):
		failure = result{"code": "", "kind": "timeout", "message": fmt.Sprintf("the worker did not finish in %d ms", timeout)}
	}
	worker.Stop()
	if !finished {
		select {
		case err := <-runErr:
			if err != nil && failure == nil {
				failure = errorOf(err)
			}
		case <-time.After(30 * time.Second):
			if failure == nil {
				failure = result{"code": "", "kind": "timeout", "message": "the worker did not stop in 30 s"}
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	var errOut any
	if failure != nil {
		errOut = failure
	}
	return result{
		"started":     append([]string{}, started...),
		"handled":     append([]result{}, handled...),
		"max_running": most,
		"endpoint":    worker.Endpoint().String(),
		"error":       errOut,
	}
}
