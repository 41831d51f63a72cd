// The conformance driver of the Go SDK: one case's input as JSON on stdin, one result as
// JSON on stdout (the protocol: conformance/README.md in the cronoq repository). It uses
// the SDK's public API only.
package main

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/cronoq/cronoq/sdk-go"
	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
	"github.com/cronoq/cronoq/sdk-go/outbox"
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
	// The outbox deployment: the application's PostgreSQL and the schema its outbox is in.
	DatabaseURL  string `json:"database_url"`
	OutboxSchema string `json:"outbox_schema"`
}

type step struct {
	Op               string          `json:"op"`
	Pool             string          `json:"pool"`
	Payload          json.RawMessage `json:"payload"`
	ID               string          `json:"id"`
	Key              string          `json:"key"`
	GroupKey         string          `json:"group_key"`
	IncludeAttempts  bool            `json:"include_attempts"`
	Filter           json.RawMessage `json:"filter"`
	DryRun           bool            `json:"dry_run"`
	TimeoutMs        int64           `json:"timeout_ms"`
	Pools            []string        `json:"pools"`
	Concurrency      int             `json:"concurrency"`
	Prefetch         *int            `json:"prefetch"` // nil: the SDK's default; 0: none
	UntilHandled     int             `json:"until_handled"`
	StopAfterStarted int             `json:"stop_after_started"`
	ShutdownGraceMs  *int64          `json:"shutdown_grace_ms"`
	Traceparent      string          `json:"traceparent"`
	Tracestate       string          `json:"tracestate"`
	DependsOn        []dependsOn     `json:"depends_on"`
	RunWhen          string          `json:"run_when"`
	// submit: the key mode (a KeyMode name), its debounce, the key TTL, and start_by as now + this.
	KeyMode       string `json:"key_mode"`
	DebounceMs    int64  `json:"debounce_ms"`
	MaxDebounceMs int64  `json:"max_debounce_ms"`
	KeyTTLMs      int64  `json:"key_ttl_ms"`
	StartByInMs   *int64 `json:"start_by_in_ms"`
	// sleep: how long.
	Ms int64 `json:"ms"`
	// get: what it returns besides the task; cancel: the task's descendants too.
	IncludeChildren          bool `json:"include_children"`
	IncludeDependencyResults bool `json:"include_dependency_results"`
	IncludeDescendants       bool `json:"include_descendants"`
	// outbox_enqueue: commit (else roll back), then look the task up by key for this long.
	Commit        bool  `json:"commit"`
	RelayWithinMs int64 `json:"relay_within_ms"`
	// put_schedule (and delete_schedule: the name): the schedule besides pool, payload and group_key.
	Name     string `json:"name"`
	Cron     string `json:"cron"`
	Timezone string `json:"timezone"`
	Paused   bool   `json:"paused"`
}

// dependsOn is one item of a depends_on: a key, a decimal id, or (in a spawn) the spawning task.
type dependsOn struct {
	Key    string `json:"key"`
	ID     string `json:"id"`
	Parent bool   `json:"parent"`
}

// spawnSpec is one item of a handled payload's "spawn".
type spawnSpec struct {
	Pool      string          `json:"pool"`
	Payload   json.RawMessage `json:"payload"`
	Key       string          `json:"key"`
	DependsOn []dependsOn     `json:"depends_on"`
	RunWhen   string          `json:"run_when"`
}

// refs are the tasks a depends_on names; parent is the spawning task's id (0: not a spawn).
func refs(items []dependsOn, parent uint64) ([]cronoq.TaskRef, error) {
	var out []cronoq.TaskRef
	for _, d := range items {
		switch {
		case d.Key != "":
			out = append(out, cronoq.ByKey(d.Key))
		case d.Parent && parent != 0:
			out = append(out, cronoq.ByID(parent))
		default:
			id, err := strconv.ParseUint(d.ID, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("depends_on id %q: %v", d.ID, err)
			}
			out = append(out, cronoq.ByID(id))
		}
	}
	return out, nil
}

// runWhen is a run_when given as the proto enum name ("": the default).
func runWhen(name string) (cronoq.RunWhen, error) {
	if name == "" {
		return 0, nil
	}
	v, ok := cronoqv1.RunWhen_value[name]
	if !ok {
		return 0, fmt.Errorf("run_when %q is not a RunWhen", name)
	}
	return cronoq.RunWhen(v), nil
}

// keyMode is a key_mode given as the proto enum name ("": the pool's default).
func keyMode(name string) (cronoq.KeyMode, error) {
	if name == "" {
		return 0, nil
	}
	v, ok := cronoqv1.KeyMode_value[name]
	if !ok {
		return 0, fmt.Errorf("key_mode %q is not a KeyMode", name)
	}
	return cronoq.KeyMode(v), nil
}

// value is a result as the protocol gives it: the JSON value of a JSON one, {"bytes_b64"}
// for raw bytes, nil when there is none.
func value(data []byte, contentType string) any {
	switch {
	case len(data) == 0:
		return nil
	case contentType == cronoq.JSONContentType:
		var v any
		if err := json.Unmarshal(data, &v); err != nil {
			return result{"invalid_json": err.Error()}
		}
		return v
	}
	return result{"bytes_b64": base64.StdEncoding.EncodeToString(data)}
}

func dependencyJSON(d cronoq.DependencyResult) result {
	return result{"id": strconv.FormatUint(d.ID, 10), "key": d.Key, "state": d.State.String(), "value": value(d.Result, d.ContentType), "error": d.Error}
}

func dependenciesJSON(deps []cronoq.DependencyResult) []result {
	out := []result{}
	for _, d := range deps {
		out = append(out, dependencyJSON(d))
	}
	return out
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
		case s.Op == "sleep":
			time.Sleep(ms(s.Ms))
			r = result{"error": nil}
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
	switch s.Op {
	case "submit":
		if s.Traceparent != "" { // the submit runs in that (remote) span's context; no SDK is installed
			carrier := propagation.MapCarrier{"traceparent": s.Traceparent, "tracestate": s.Tracestate}
			ctx = propagation.TraceContext{}.Extract(ctx, carrier)
		}
		dependencies, err := refs(s.DependsOn, 0)
		if err != nil {
			return result{"error": result{"code": "", "kind": "other", "message": err.Error()}}
		}
		when, err := runWhen(s.RunWhen)
		if err != nil {
			return result{"error": result{"code": "", "kind": "other", "message": err.Error()}}
		}
		mode, err := keyMode(s.KeyMode)
		if err != nil {
			return result{"error": result{"code": "", "kind": "other", "message": err.Error()}}
		}
		spec := cronoq.TaskSpec{
			Pool: s.Pool, Key: s.Key, GroupKey: s.GroupKey, Payload: s.Payload, DependsOn: dependencies, RunWhen: when,
			KeyMode: mode, Debounce: ms(s.DebounceMs), MaxDebounce: ms(s.MaxDebounceMs), KeyTTL: ms(s.KeyTTLMs),
		}
		if s.StartByInMs != nil {
			spec.StartBy = time.Now().Add(ms(*s.StartByInMs))
		}
		sub, err := client.Submit(ctx, spec)
		if err != nil {
			return result{"error": errorOf(err)}
		}
		return result{"id": strconv.FormatUint(sub.Task.GetId(), 10), "group_key": sub.Task.GetGroupKey(),
			"deduplicated": sub.Deduplicated, "replaced": sub.Replaced, "error": nil}
	case "pause_pool", "resume_pool":
		change := client.PausePool
		if s.Op == "resume_pool" {
			change = client.ResumePool
		}
		p, err := change(ctx, s.Pool)
		if err != nil {
			return result{"error": errorOf(err)}
		}
		return result{"pool": p.GetPool(), "paused": p.GetPaused(), "error": nil}
	case "bulk_cancel", "bulk_retry", "bulk_delete":
		return bulkStep(ctx, client, s)
	case "outbox_enqueue":
		return outboxEnqueue(ctx, client, in, s)
	case "put_schedule", "delete_schedule", "list_schedules", "list_workers", "server_info", "snapshot":
		out, err := readStep(ctx, client, s)
		if err != nil {
			return result{"error": errorOf(err)}
		}
		out["error"] = nil
		return out
	}
	ref, err := taskRef(s)
	if err != nil {
		return result{"error": result{"code": "", "kind": "other", "message": err.Error()}}
	}
	var task *cronoq.Task
	out := result{"error": nil}
	switch s.Op {
	case "get":
		var got *cronoq.TaskDetails
		got, err = client.GetWith(ctx, ref, cronoq.GetOptions{
			IncludeAttempts: s.IncludeAttempts, IncludeChildren: s.IncludeChildren, IncludeDependencyResults: s.IncludeDependencyResults,
		})
		if err != nil {
			break
		}
		task = got.Task
		if s.IncludeAttempts {
			attempts := []result{}
			for _, a := range got.Attempts {
				attempts = append(attempts, result{"attempt": a.GetAttempt(), "outcome": a.GetOutcome().String(), "error": a.GetError()})
			}
			out["attempts"] = attempts
		}
		if s.IncludeChildren {
			children := []result{}
			for _, c := range got.Children {
				children = append(children, result{"id": strconv.FormatUint(c.GetId(), 10), "pool": c.GetPool(),
					"state": c.GetState().String(), "parent_id": strconv.FormatUint(c.GetParentId(), 10)})
			}
			out["children"] = children
		}
		if s.IncludeDependencyResults {
			out["dependency_results"] = dependenciesJSON(cronoq.DependencyResultsOf(task))
		}
	case "cancel":
		var cancelled *cronoq.Cancelled
		if cancelled, err = client.CancelWith(ctx, ref, cronoq.CancelOptions{IncludeDescendants: s.IncludeDescendants}); err == nil {
			task = cancelled.Task
			if s.IncludeDescendants {
				out["descendants_cancelled"] = cancelled.DescendantsCancelled
			}
		}
	case "retry":
		var retried *cronoq.Retried
		if retried, err = client.Retry(ctx, ref, cronoq.RetryOptions{}); err == nil {
			task = retried.Task
		}
	case "delete":
		var id uint64
		if id, err = client.Delete(ctx, ref); err != nil {
			return result{"error": errorOf(err)}
		}
		return result{"id": strconv.FormatUint(id, 10), "error": nil}
	case "wait":
		timeout := int64(10000)
		if s.TimeoutMs > 0 {
			timeout = s.TimeoutMs
		}
		var waited *cronoq.Waited
		if waited, err = client.Wait(ctx, ref, ms(timeout)); err == nil {
			task = waited.Task
		}
	default:
		return result{"error": result{"code": "", "kind": "unsupported", "message": fmt.Sprintf("unknown op %q", s.Op)}}
	}
	if err != nil {
		return result{"error": errorOf(err)}
	}
	out["id"] = strconv.FormatUint(task.GetId(), 10)
	out["state"] = task.GetState().String()
	if s.Op == "get" {
		out["snoozes"] = task.GetSnoozes()
		out["progress"] = nil
		if p := task.GetProgress(); p != nil {
			out["progress"] = result{"value": p.GetValue(), "message": p.GetMessage()}
		}
		out["checkpoint"] = text(task.GetCheckpoint())
		out["parent_id"] = strconv.FormatUint(task.GetParentId(), 10)
		out["task_error"] = task.GetError()
		out["result"] = value(task.GetResult(), task.GetResultContentType())
	}
	return out
}

// scheduleJSON is a schedule as the protocol gives it.
func scheduleJSON(schedule *cronoq.Schedule) result {
	return result{
		"pool": schedule.GetPool(), "name": schedule.GetName(), "cron": schedule.GetCron(), "timezone": schedule.GetTimezone(),
		"paused": schedule.GetPaused(), "group_key": schedule.GetGroupKey(), "next_fire_set": schedule.GetNextFireAt() != nil,
	}
}

// readStep runs the schedule calls and the read calls (workers, the server's info, the snapshot).
func readStep(ctx context.Context, client *cronoq.Client, s step) (result, error) {
	switch s.Op {
	case "put_schedule":
		schedule, err := client.PutSchedule(ctx, cronoq.ScheduleSpec{
			Pool: s.Pool, Name: s.Name, Cron: s.Cron, Payload: s.Payload, Timezone: s.Timezone, GroupKey: s.GroupKey, Paused: s.Paused,
		})
		if err != nil {
			return nil, err
		}
		return scheduleJSON(schedule), nil
	case "delete_schedule":
		return result{}, client.DeleteSchedule(ctx, s.Pool, s.Name)
	case "list_schedules":
		listed, err := client.ListSchedules(ctx, s.Pool)
		if err != nil {
			return nil, err
		}
		sorted := slices.SortedFunc(slices.Values(listed.GetSchedules()), func(a, b *cronoq.Schedule) int {
			return cmp.Or(cmp.Compare(a.GetPool(), b.GetPool()), cmp.Compare(a.GetName(), b.GetName()))
		})
		schedules := []result{}
		for _, schedule := range sorted {
			schedules = append(schedules, scheduleJSON(schedule))
		}
		return result{"schedules": schedules, "unavailable_shards": append([]string{}, listed.GetUnavailableShards()...)}, nil
	case "list_workers":
		workers, err := client.ListWorkers(ctx, s.Pool)
		if err != nil {
			return nil, err
		}
		return result{"count": len(workers.GetWorkers()), "unavailable_shards": append([]string{}, workers.GetUnavailableShards()...)}, nil
	case "server_info":
		info, err := client.ServerInfo(ctx)
		if err != nil {
			return nil, err
		}
		return result{"shard": info.GetShard(), "role": info.GetRole().String(), "version": info.GetVersion()}, nil
	}
	snapshot, err := client.Snapshot(ctx)
	if err != nil {
		return nil, err
	}
	shards := []string{}
	for _, shard := range snapshot.GetShards() {
		shards = append(shards, shard.GetShard())
	}
	slices.Sort(shards)
	return result{"shards": shards, "unavailable_shards": append([]string{}, snapshot.GetUnavailableShards()...)}, nil
}

// outboxEnqueue enqueues one task with the outbox helper in a pgx transaction of the
// application's database, commits or rolls it back, and with relay_within_ms looks the task up
// by key until it exists.
func outboxEnqueue(ctx context.Context, client *cronoq.Client, in *input, s step) result {
	conn, err := pgx.Connect(ctx, in.DatabaseURL)
	if err != nil {
		return result{"error": errorOf(err)}
	}
	defer func() { _ = conn.Close(ctx) }()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return result{"error": errorOf(err)}
	}
	defer func() { _ = tx.Rollback(ctx) }() // after Commit, a no-op
	id, err := outbox.Enqueue(ctx, tx, cronoq.TaskSpec{Pool: s.Pool, Key: s.Key, Payload: s.Payload}, outbox.WithSchema(in.OutboxSchema))
	if err != nil {
		return result{"error": errorOf(err)}
	}
	if s.Commit {
		err = tx.Commit(ctx)
	} else {
		err = tx.Rollback(ctx)
	}
	if err != nil {
		return result{"error": errorOf(err)}
	}
	committed, relayed := time.Now(), false
	for s.RelayWithinMs > 0 && !relayed && time.Since(committed) < ms(s.RelayWithinMs) {
		if _, err := client.Get(ctx, cronoq.ByKey(s.Key)); err == nil {
			relayed = true
		} else if errors.Is(err, cronoq.ErrNotFound) {
			time.Sleep(5 * time.Millisecond)
		} else {
			return result{"error": errorOf(err)}
		}
	}
	relayMs := 0.0
	if s.RelayWithinMs > 0 {
		relayMs = float64(time.Since(committed).Microseconds()) / 1000
	}
	return result{"id": strconv.FormatInt(id, 10), "relayed": relayed, "relay_ms": relayMs, "error": nil}
}

// text is a checkpoint as UTF-8 text, nil when there is none.
func text(checkpoint []byte) any {
	if len(checkpoint) == 0 {
		return nil
	}
	return string(checkpoint)
}

// taskRef is the task a step names: by "id" or by "key".
func taskRef(s step) (cronoq.TaskRef, error) {
	if s.ID == "" && s.Key != "" {
		return cronoq.ByKey(s.Key), nil
	}
	id, err := strconv.ParseUint(s.ID, 10, 64)
	if err != nil {
		return cronoq.TaskRef{}, fmt.Errorf("id %q: %v", s.ID, err)
	}
	return cronoq.ByID(id), nil
}

// bulkStep runs a bulk action; its filter is a TaskFilter in proto JSON form.
func bulkStep(ctx context.Context, client *cronoq.Client, s step) result {
	var pf cronoqv1.TaskFilter
	if len(s.Filter) > 0 {
		if err := protojson.Unmarshal(s.Filter, &pf); err != nil {
			return result{"error": result{"code": "", "kind": "other", "message": fmt.Sprintf("filter %s: %v", s.Filter, err)}}
		}
	}
	timeOf := func(ts *timestamppb.Timestamp) time.Time {
		if ts == nil {
			return time.Time{}
		}
		return ts.AsTime()
	}
	filter := cronoq.TaskFilter{
		Pool: pf.GetPool(), States: pf.GetStates(), KeyPrefix: pf.GetKeyPrefix(), ErrorContains: pf.GetErrorContains(), IDs: pf.GetIds(),
		ParentID:     pf.GetParentId(),
		CreatedAfter: timeOf(pf.GetCreatedAfter()), CreatedBefore: timeOf(pf.GetCreatedBefore()),
		FinishedAfter: timeOf(pf.GetFinishedAfter()), FinishedBefore: timeOf(pf.GetFinishedBefore()),
	}
	var res *cronoq.BulkResult
	var err error
	switch s.Op {
	case "bulk_cancel":
		res, err = client.CancelTasks(ctx, filter, cronoq.BulkOptions{DryRun: s.DryRun})
	case "bulk_retry":
		res, err = client.RetryTasks(ctx, filter, cronoq.BulkRetryOptions{DryRun: s.DryRun})
	default:
		res, err = client.DeleteTasks(ctx, filter, cronoq.BulkOptions{DryRun: s.DryRun})
	}
	if err != nil {
		return result{"error": errorOf(err)}
	}
	return result{"matched": res.Matched, "changed": res.Changed, "unavailable_shards": append([]string{}, res.UnavailableShards...), "error": nil}
}

// spawn spawns what a handled payload's "spawn" lists, in order.
func spawn(t *cronoq.TaskContext, task *cronoq.Task, list any) error {
	if list == nil {
		return nil
	}
	raw, _ := json.Marshal(list)
	var specs []spawnSpec
	if err := json.Unmarshal(raw, &specs); err != nil {
		return cronoq.NonRetryable(fmt.Errorf("spawn %s: %v", raw, err))
	}
	for _, sp := range specs {
		dependencies, err := refs(sp.DependsOn, task.GetId())
		if err != nil {
			return cronoq.NonRetryable(err)
		}
		when, err := runWhen(sp.RunWhen)
		if err != nil {
			return cronoq.NonRetryable(err)
		}
		opts := []cronoq.SpawnOption{cronoq.SpawnDependsOn(dependencies...), cronoq.SpawnRunWhen(when)}
		if sp.Key != "" {
			opts = append(opts, cronoq.SpawnKey(sp.Key))
		}
		if err := t.Spawn(sp.Pool, sp.Payload, opts...); err != nil {
			return err
		}
	}
	return nil
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
		t := cronoq.TaskContextFrom(ctx)
		snoozes, checkpoint := t.Snoozes(), text(t.Checkpoint())
		var traceID any // the trace of the handler's current span, null when none
		if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
			traceID = sc.TraceID().String()
		}
		var payload map[string]any
		var raw any
		_ = cronoq.DecodePayload(task, &raw)
		payload, _ = raw.(map[string]any)
		dependencies := dependenciesJSON(t.DependencyResults())
		var lookedUp result // by the SDK's lookup, when the payload asks
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
			entry := result{"id": id, "attempt": task.GetAttempt(), "snoozes": snoozes, "checkpoint": checkpoint,
				"trace_id": traceID, "payload": raw, "end": end, "dependencies": dependencies}
			if lookedUp != nil {
				entry["looked_up"] = lookedUp
			}
			handled = append(handled, entry)
			if len(handled) == s.UntilHandled {
				signal()
			}
			mu.Unlock()
		}()
		if saved, ok := payload["checkpoint"].(string); ok {
			if err := t.SaveCheckpoint([]byte(saved)); err != nil {
				end = "raised"
				return nil, err
			}
		}
		progress, _ := payload["progress"].([]any)
		for _, p := range progress {
			p, _ := p.(map[string]any)
			value, _ := p["value"].(float64)
			message, _ := p["message"].(string)
			if err := t.ReportProgress(value, message); err != nil {
				end = "raised"
				return nil, err
			}
		}
		if n, ok := payload["sleep_ms"].(float64); ok && n > 0 {
			select {
			case <-time.After(ms(int64(n))):
			case <-ctx.Done():
				return nil, context.Cause(ctx)
			}
		}
		if n, ok := payload["snooze_ms"].(float64); ok {
			times := 1.0
			if v, ok := payload["snooze_times"].(float64); ok {
				times = v
			}
			if float64(snoozes) < times {
				end = "snoozed"
				return nil, cronoq.Snooze(ms(int64(n)), "driver")
			}
		}
		if keys, ok := payload["lookup_keys"].([]any); ok {
			lookedUp = result{}
			for _, k := range keys {
				key := fmt.Sprint(k)
				lookedUp[key] = nil
				if d, ok := t.Dependency(key); ok {
					lookedUp[key] = value(d.Result, d.ContentType)
				}
			}
		}
		if err := spawn(t, task, payload["spawn"]); err != nil {
			end = "raised"
			return nil, err
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
		if sum, _ := payload["sum_dependencies"].(bool); sum {
			total := 0.0
			for _, d := range t.DependencyResults() {
				var n float64
				if d.Decode(&n) == nil {
					total += n
				}
			}
			return total, nil
		}
		if b64, ok := payload["result_bytes_b64"].(string); ok {
			return base64.StdEncoding.DecodeString(b64)
		}
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
	prefetch := 0 // the SDK's default
	switch {
	case s.Prefetch == nil:
	case *s.Prefetch == 0:
		prefetch = cronoq.NoPrefetch
	default:
		prefetch = *s.Prefetch
	}
	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{
		Options:       opts,
		Pools:         s.Pools,
		Concurrency:   concurrency,
		Prefetch:      prefetch,
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
