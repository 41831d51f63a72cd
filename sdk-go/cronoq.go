// Package cronoq is the Go SDK of cronoq, a durable sharded task queue: a Client that
// submits, reads, waits for, cancels, retries and deletes tasks (one by one or by filter),
// puts cron schedules, pauses pools and reads the workers and the servers' state, and a Worker
// that runs them.
//
//	client, err := cronoq.NewClient(cronoq.Options{Endpoint: "http://127.0.0.1:7070"})
//	sub, err := client.Submit(ctx, cronoq.TaskSpec{Pool: "default", Payload: map[string]int{"n": 21}})
//
//	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{Pools: []string{"default"}},
//		func(ctx context.Context, task *cronoq.Task) (any, error) {
//			var in struct{ N int }
//			if err := cronoq.DecodePayload(task, &in); err != nil {
//				return nil, cronoq.NonRetryable(err)
//			}
//			return map[string]int{"doubled": in.N * 2}, nil
//		})
//	err = worker.Run(ctx) // until ctx is done or worker.Stop(); running tasks finish first
//
// Every call takes a context; errors are *Error values that match the sentinels of their
// gRPC code with errors.Is (ErrNotFound, ErrUnavailable, ...) and carry the server's
// reason, shard, shard endpoint and leader. Task ids are uint64: all 64 bits are used.
package cronoq

import (
	"encoding/json"
	"fmt"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// Task is a task as the server holds it (the generated cronoq.v1.Task).
type Task = cronoqv1.Task

// TaskState is a task's lifecycle state.
type TaskState = cronoqv1.TaskState

// The task states.
const (
	TaskStatePending   = cronoqv1.TaskState_TASK_STATE_PENDING
	TaskStateBlocked   = cronoqv1.TaskState_TASK_STATE_BLOCKED
	TaskStateRunning   = cronoqv1.TaskState_TASK_STATE_RUNNING
	TaskStateSucceeded = cronoqv1.TaskState_TASK_STATE_SUCCEEDED
	TaskStateFailed    = cronoqv1.TaskState_TASK_STATE_FAILED
	TaskStateCancelled = cronoqv1.TaskState_TASK_STATE_CANCELLED
	// TaskStateExpired: not started by its TaskSpec.StartBy, it ended without running (a
	// failure, to the tasks that depend on it).
	TaskStateExpired = cronoqv1.TaskState_TASK_STATE_EXPIRED
)

// Attempt is one attempt of a task (the generated cronoq.v1.Attempt): GetWithAttempts.
type Attempt = cronoqv1.Attempt

// AttemptOutcome is how an attempt ended.
type AttemptOutcome = cronoqv1.AttemptOutcome

// The attempt outcomes.
const (
	AttemptOutcomeRunning   = cronoqv1.AttemptOutcome_ATTEMPT_OUTCOME_RUNNING
	AttemptOutcomeSucceeded = cronoqv1.AttemptOutcome_ATTEMPT_OUTCOME_SUCCEEDED
	AttemptOutcomeFailed    = cronoqv1.AttemptOutcome_ATTEMPT_OUTCOME_FAILED
	AttemptOutcomeCancelled = cronoqv1.AttemptOutcome_ATTEMPT_OUTCOME_CANCELLED
	// AttemptOutcomeLost: the lease expired (the worker stopped heartbeating).
	AttemptOutcomeLost = cronoqv1.AttemptOutcome_ATTEMPT_OUTCOME_LOST
	// AttemptOutcomeSnoozed: the handler snoozed the task (Snooze); the attempt is not counted.
	AttemptOutcomeSnoozed = cronoqv1.AttemptOutcome_ATTEMPT_OUTCOME_SNOOZED
)

// PoolPause is whether a pool is paused, since when and by whom (the generated
// cronoq.v1.PoolPause): PausePool and ResumePool.
type PoolPause = cronoqv1.PoolPause

// Schedule is a cron schedule as the server holds it, with its NextFireAt and LastFireAt
// (the generated cronoq.v1.Schedule): PutSchedule and ListSchedules.
type Schedule = cronoqv1.Schedule

// BulkShardResult is what a bulk action did in one shard (the generated cronoq.v1.BulkShardResult).
type BulkShardResult = cronoqv1.BulkShardResult

// RunWhen is when a task with dependencies runs (TaskSpec.RunWhen).
type RunWhen = cronoqv1.RunWhen

// The RunWhen values; the zero value is RunWhenDependenciesSucceeded.
const (
	// RunWhenDependenciesSucceeded: once every dependency has succeeded; one that fails or is
	// cancelled ends the task FAILED (or CANCELLED) without running it.
	RunWhenDependenciesSucceeded = cronoqv1.RunWhen_RUN_WHEN_DEPENDENCIES_SUCCEEDED
	// RunWhenDependenciesEnded: once every dependency has ended, whatever its outcome (a
	// finalizer): the handler sees each one's state and error in its DependencyResults.
	RunWhenDependenciesEnded = cronoqv1.RunWhen_RUN_WHEN_DEPENDENCIES_ENDED
)

// KeyMode is what a submission whose key already names a task does (TaskSpec.KeyMode).
type KeyMode = cronoqv1.KeyMode

// The KeyMode values; the zero value takes the pool's default_key_mode (KeyModeReturnExisting
// unless configured).
const (
	// KeyModeReturnExisting: nothing changes, the existing task is returned (Submitted.Deduplicated).
	KeyModeReturnExisting = cronoqv1.KeyMode_KEY_MODE_RETURN_EXISTING
	// KeyModeReplacePending: while the existing task is PENDING or BLOCKED (in the same pool),
	// its payload, content type, priority and run_at become the submission's
	// (Submitted.Replaced); once it runs or has ended, as KeyModeReturnExisting.
	KeyModeReplacePending = cronoqv1.KeyMode_KEY_MODE_REPLACE_PENDING
	// KeyModeDebounce: as KeyModeReplacePending, and the task is due TaskSpec.Debounce after
	// each submission, but never later than TaskSpec.MaxDebounce after the first (when set):
	// a burst runs once, after it.
	KeyModeDebounce = cronoqv1.KeyMode_KEY_MODE_DEBOUNCE
)

// DependencyResult is how one dependency of a task ended: its handler's result when it
// succeeded, its error when it failed or was cancelled.
type DependencyResult struct {
	ID    uint64
	Key   string // "" when it has none
	State TaskState
	// Result as the dependency's handler returned it (see EncodePayload), with its content
	// type: JSONContentType for JSON (Decode reads it), anything else for raw bytes.
	Result      []byte
	ContentType string
	Error       string
}

// Decode reads the dependency's JSON result into v, as DecodeResult reads a task's.
func (d DependencyResult) Decode(v any) error {
	return decodeJSON(d.Result, d.ContentType, "result", d.ID, v)
}

// DependencyResultsOf is how the dependencies of a task ended, in depends_on order: a leased
// task carries them, and so does one read with GetOptions.IncludeDependencyResults.
func DependencyResultsOf(task *Task) []DependencyResult {
	var results []DependencyResult
	for _, d := range task.GetDependencyResults() {
		results = append(results, DependencyResult{
			ID: d.GetId(), Key: d.GetKey(), State: d.GetState(), Result: d.GetResult(), ContentType: d.GetContentType(), Error: d.GetError(),
		})
	}
	return results
}

// Terminal reports whether a task in this state will not change again.
func Terminal(s TaskState) bool {
	return s == TaskStateSucceeded || s == TaskStateFailed || s == TaskStateCancelled || s == TaskStateExpired
}

// JSONContentType marks payloads and results stored as JSON.
const JSONContentType = "application/json"

// EncodePayload is how the SDK stores a payload or a result: []byte as it is, nil as
// nothing, json.RawMessage and anything else as JSON.
func EncodePayload(v any) (data []byte, contentType string, err error) {
	switch p := v.(type) {
	case nil:
		return nil, "", nil
	case []byte:
		return p, "", nil
	case json.RawMessage:
		if len(p) == 0 {
			return nil, "", nil
		}
		return p, JSONContentType, nil
	}
	data, err = json.Marshal(v)
	if err != nil {
		return nil, "", fmt.Errorf("cronoq: encoding as JSON: %w", err)
	}
	return data, JSONContentType, nil
}

// DecodePayload reads the task's JSON payload into v.
func DecodePayload(task *Task, v any) error {
	return decodeJSON(task.GetPayload(), task.GetContentType(), "payload", task.GetId(), v)
}

// DecodeResult reads the task's JSON result into v.
func DecodeResult(task *Task, v any) error {
	return decodeJSON(task.GetResult(), task.GetResultContentType(), "result", task.GetId(), v)
}

func decodeJSON(data []byte, contentType, what string, id uint64, v any) error {
	if contentType != JSONContentType {
		return fmt.Errorf("cronoq: task %d: the %s is not JSON (content type %q)", id, what, contentType)
	}
	if len(data) == 0 {
		data = []byte("null")
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("cronoq: task %d: decoding the %s: %w", id, what, err)
	}
	return nil
}
