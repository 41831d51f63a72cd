package cronoq

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// DependencyResults is how the task's dependencies ended, in depends_on order (one deleted
// since is left out); nil for a task without dependencies, or a ctx not a handler's.
func (t *TaskContext) DependencyResults() []DependencyResult {
	if t == nil {
		return nil
	}
	return t.dependencies
}

// Dependency is the dependency named by keyOrID: its key (a string) or its id (an integer);
// false when the task has no such dependency.
func (t *TaskContext) Dependency(keyOrID any) (DependencyResult, bool) {
	var match func(DependencyResult) bool
	switch ref := keyOrID.(type) {
	case string:
		match = func(d DependencyResult) bool { return d.Key == ref }
	case uint64:
		match = func(d DependencyResult) bool { return d.ID == ref }
	case int: // an untyped constant: t.Dependency(42)
		match = func(d DependencyResult) bool { return ref >= 0 && d.ID == uint64(ref) }
	case int64:
		match = func(d DependencyResult) bool { return ref >= 0 && d.ID == uint64(ref) }
	default:
		return DependencyResult{}, false
	}
	for _, d := range t.DependencyResults() {
		if match(d) {
			return d, true
		}
	}
	return DependencyResult{}, false
}

// SpawnOption sets a field of the task Spawn submits: SpawnKey, SpawnDependsOn,
// SpawnRunWhen, or any function of its TaskSpec (its Priority, Delay, GroupKey, ...).
type SpawnOption func(*TaskSpec)

// SpawnKey gives the spawned task a key, which the other tasks the handler spawns may depend on.
func SpawnKey(key string) SpawnOption {
	return func(s *TaskSpec) { s.Key = key }
}

// SpawnDependsOn makes the spawned task depend on these: ByKey of another task the handler
// spawns (or of any task of the shard), ByID(task.GetId()) for the spawning task itself.
func SpawnDependsOn(refs ...TaskRef) SpawnOption {
	return func(s *TaskSpec) { s.DependsOn = append(s.DependsOn, refs...) }
}

// SpawnRunWhen sets when the spawned task runs, given its dependencies (TaskSpec.RunWhen).
func SpawnRunWhen(when RunWhen) SpawnOption {
	return func(s *TaskSpec) { s.RunWhen = when }
}

// Spawn adds a task to submit in pool with payload (encoded as Submit encodes it) when the
// handler succeeds: the tasks it spawns are sent with its success and created with it, in one
// transaction, each with the task's id as ParentId and the handler's trace context. A handler
// that fails, snoozes or is cancelled spawns nothing. The server fails the attempt, not
// retryable, when it cannot submit them (a pool of another shard, a permission, more than its
// max_batch_size). A payload that cannot be encoded is an ErrInvalidArgument error; a spawn
// after the handler returned is an ErrFailedPrecondition error: nothing is added.
func (t *TaskContext) Spawn(pool string, payload any, opts ...SpawnOption) error {
	if t == nil {
		return errNotAHandler
	}
	spec := TaskSpec{Pool: pool, Payload: payload}
	for _, opt := range opts {
		opt(&spec)
	}
	req, err := spec.proto()
	if err != nil {
		return err
	}
	req.Trace = traceContext(trace.ContextWithSpanContext(context.Background(), t.span))
	// A text that is not UTF-8 would make the whole message of outcomes unsendable.
	if _, err := proto.Marshal(req); err != nil {
		return newError(codes.InvalidArgument, kindCode, "spawn into pool %q: %v", pool, err)
	}
	t.w.mu.Lock()
	defer t.w.mu.Unlock()
	if t.w.running[t.id] != t.rt {
		return newError(codes.FailedPrecondition, kindCode, "task %d: its handler has returned: nothing more is spawned", t.id)
	}
	t.rt.spawned = append(t.rt.spawned, req)
	return nil
}

// withSpawned puts what the handler spawned into its success outcome (nothing into another),
// or fails the attempt, not retryable, when the outcome would not fit one message.
func withSpawned(outcome *cronoqv1.TaskOutcome, spawned []*cronoqv1.SubmitTaskRequest) {
	success := outcome.GetSuccess()
	if success == nil || len(spawned) == 0 {
		return
	}
	success.Spawn = spawned
	if size := proto.Size(outcome); size > maxRequestBytes {
		outcome.Outcome = &cronoqv1.TaskOutcome_Failure{Failure: &cronoqv1.TaskFailure{
			Error: fmt.Sprintf("the result and %d spawned tasks are %d bytes, more than a message's %d", len(spawned), size, maxRequestBytes),
		}}
	}
}
