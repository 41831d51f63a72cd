package cronoq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"iter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// Client calls cronoq: any shard's server, or several servers (Options.Endpoint with
// commas). UNAVAILABLE moves it to the leader a standby names, or to the next endpoint,
// and is retried with backoff. A Client is safe for concurrent use; Close it when done.
type Client struct {
	conn *connection
}

// NewClient checks the options (endpoints, TLS files) and returns a Client; it connects
// on its first call.
func NewClient(opts Options) (*Client, error) {
	opts = opts.withDefaults()
	conn, err := newConnection(&opts)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn}, nil
}

// Endpoint is the server the client talks to now.
func (c *Client) Endpoint() Endpoint { return c.conn.endpoint() }

// Close closes the client's connections.
func (c *Client) Close() error { return c.conn.close() }

// TaskRef names one task, by id or by key: ByID or ByKey.
type TaskRef struct {
	ref *cronoqv1.TaskRef
}

// ByID names a task by its id.
func ByID(id uint64) TaskRef {
	return TaskRef{&cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Id{Id: id}}}
}

// ByKey names a task by its key (unique within a shard).
func ByKey(key string) TaskRef {
	return TaskRef{&cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Key{Key: key}}}
}

func (r TaskRef) proto() (*cronoqv1.TaskRef, error) {
	if r.ref == nil {
		return nil, newError(codes.InvalidArgument, kindCode, "task: give cronoq.ByID(id) or cronoq.ByKey(key)")
	}
	return r.ref, nil
}

// TaskSpec is one task to submit.
type TaskSpec struct {
	Pool string
	// Payload: []byte as it is, anything else as JSON (see EncodePayload).
	Payload any
	// Key deduplicates within a shard: a known key returns the existing task, or updates it
	// as KeyMode says.
	Key string
	// KeyMode: what a submission whose key already names a task does; the zero value takes
	// the pool's default_key_mode (KeyModeReturnExisting unless configured). Needs a Key.
	KeyMode KeyMode
	// Debounce, with KeyModeDebounce (1 ms to 7 days; 0: the pool's debounce, which it then
	// needs): the task is due this long after the latest submission of its key. RunAt and
	// Delay may not be given with KeyModeDebounce.
	Debounce time.Duration
	// MaxDebounce, with KeyModeDebounce (0: no bound, or the pool's max_debounce; else Debounce
	// to 7 days): the task is due at most this long after the submission that created it,
	// however long the burst lasts.
	MaxDebounce time.Duration
	// KeyTTL: unique for a period: once the task has ended and this long has passed, its key
	// is free and a new submission with it creates a new task (0: held until the task is
	// deleted; at most 366 days). Needs a Key.
	KeyTTL   time.Duration
	Priority int32
	// RunAt: not before this time; Delay: not before now + Delay (RunAt wins when both are set).
	RunAt time.Time
	Delay time.Duration
	// StartBy: a deadline to start: a task none of whose attempts has started by then ends
	// TaskStateExpired without running. After RunAt (or now + Delay) when given; zero: none.
	StartBy time.Time
	// MaxAttempts: 0 takes the pool's default.
	MaxAttempts int32
	// DependsOn: tasks of the same shard (a batch may name its own keys).
	DependsOn []TaskRef
	// RunWhen: when it runs, given its dependencies; the zero value is
	// RunWhenDependenciesSucceeded, RunWhenDependenciesEnded makes it a finalizer.
	RunWhen   RunWhen
	Resources map[string]int64
	// Timeout of each attempt (capped by the pool's); 0: the pool's.
	Timeout time.Duration
	// GroupKey is the task's group (a tenant, a user; "": none): in a pool with
	// max_running_per_group, at most that many tasks of one group run at once.
	GroupKey string
}

func (s TaskSpec) proto() (*cronoqv1.SubmitTaskRequest, error) {
	data, contentType, err := encodePayloadArg(s.Payload)
	if err != nil {
		return nil, err
	}
	req := &cronoqv1.SubmitTaskRequest{
		Pool:        s.Pool,
		Key:         s.Key,
		Payload:     data,
		ContentType: contentType,
		Priority:    s.Priority,
		MaxAttempts: s.MaxAttempts,
		Resources:   s.Resources,
		GroupKey:    s.GroupKey,
		RunWhen:     s.RunWhen,
		KeyMode:     s.KeyMode,
		// Negative durations are sent as they are, for the checks to name them.
		DebounceMs:    milliseconds(s.Debounce),
		MaxDebounceMs: milliseconds(s.MaxDebounce),
		KeyTtlMs:      milliseconds(s.KeyTTL),
	}
	if s.Timeout > 0 {
		req.TimeoutMs = milliseconds(s.Timeout)
	}
	req.RunAt = runAt(s.RunAt, s.Delay)
	if !s.StartBy.IsZero() {
		req.StartBy = timestamppb.New(s.StartBy)
	}
	for _, d := range s.DependsOn {
		ref, err := d.proto()
		if err != nil {
			return nil, err
		}
		req.DependsOn = append(req.DependsOn, ref)
	}
	return req, nil
}

// encodePayloadArg is EncodePayload for a payload given to a call: a value JSON cannot encode
// is the call's ErrInvalidArgument error, as the server's refusal would be.
func encodePayloadArg(v any) (data []byte, contentType string, err error) {
	data, contentType, err = EncodePayload(v)
	if err != nil {
		return nil, "", newError(codes.InvalidArgument, kindCode, "payload: %v", err)
	}
	return data, contentType, nil
}

// milliseconds is d in whole milliseconds, at least 1 (or -1) for a d shorter than one, so
// that a duration given is never sent as "none".
func milliseconds(d time.Duration) int64 {
	switch {
	case d > 0:
		return max(d.Milliseconds(), 1)
	case d < 0:
		return min(d.Milliseconds(), -1)
	}
	return 0
}

// runAt is "not before at, or now + delay": nil (now) when neither is set; at wins.
func runAt(at time.Time, delay time.Duration) *timestamppb.Timestamp {
	switch {
	case !at.IsZero():
		return timestamppb.New(at)
	case delay > 0:
		return timestamppb.New(time.Now().Add(delay))
	}
	return nil
}

// NewRequestID is a fresh request id: the server answers a repeated one with what the
// first call created.
func NewRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Submitted is a submission's answer.
type Submitted struct {
	Task *Task
	// Deduplicated: the key already named a task; nothing was created or changed.
	Deduplicated bool
	// Replaced: the key named a PENDING or BLOCKED task whose payload, content type, priority
	// and run_at this submission replaced (KeyModeReplacePending, KeyModeDebounce); nothing
	// was created.
	Replaced bool
}

// Submit submits one task. Every transport retry of the call carries the same request id,
// so a retry after UNAVAILABLE returns the task the first attempt created. When ctx has a
// valid OpenTelemetry span context (its current span), the task carries it (W3C traceparent
// and tracestate), and every attempt's handler runs in that trace (see the README's Tracing).
func (c *Client) Submit(ctx context.Context, spec TaskSpec) (*Submitted, error) {
	req, err := spec.proto()
	if err != nil {
		return nil, err
	}
	req.RequestId = NewRequestID()
	req.Trace = traceContext(ctx)
	var resp *cronoqv1.SubmitTaskResponse
	err = c.conn.invoke(ctx, "SubmitTask", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).SubmitTask(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Submitted{Task: resp.GetTask(), Deduplicated: resp.GetDeduplicated(), Replaced: resp.GetReplaced()}, nil
}

// SubmitBatch admits every task or none; tasks may depend on the batch's own keys.
// The answer lists the tasks in the order given, the ids that already existed
// (DeduplicatedIds) and those whose pending task it replaced (ReplacedIds). Each task
// carries ctx's trace context, as Submit's does.
func (c *Client) SubmitBatch(ctx context.Context, specs []TaskSpec) (*cronoqv1.SubmitBatchResponse, error) {
	req := &cronoqv1.SubmitBatchRequest{RequestId: NewRequestID()}
	trace := traceContext(ctx)
	for _, spec := range specs {
		task, err := spec.proto()
		if err != nil {
			return nil, err
		}
		task.Trace = trace
		req.Tasks = append(req.Tasks, task)
	}
	var resp *cronoqv1.SubmitBatchResponse
	err := c.conn.invoke(ctx, "SubmitBatch", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).SubmitBatch(ctx, req, opts...)
		return err
	})
	return resp, err
}

// Get reads one task.
func (c *Client) Get(ctx context.Context, ref TaskRef) (*Task, error) {
	resp, err := c.getTask(ctx, ref, GetOptions{})
	return resp.GetTask(), err
}

// GetOptions say what GetWith returns besides the task.
type GetOptions struct {
	// IncludeAttempts: the task's attempts (TaskDetails.Attempts).
	IncludeAttempts bool
	// IncludeChildren: the tasks its handler spawned (TaskDetails.Children).
	IncludeChildren bool
	// IncludeDependencyResults: the task's dependency results as its handler sees them
	// (DependencyResultsOf(details.Task)).
	IncludeDependencyResults bool
}

// TaskDetails is a GetWith's answer.
type TaskDetails struct {
	Task *Task
	// Attempts, oldest first (one running now is last), with IncludeAttempts.
	Attempts []*Attempt
	// Children: the tasks its handler spawned (their ParentId is its id), in pools the caller
	// may read, in id order, at most 1,000 (List with TaskFilter.ParentID pages through them
	// all), without payload, result or checkpoint; with IncludeChildren.
	Children []*Task
}

// GetWith reads one task with what opts ask for.
func (c *Client) GetWith(ctx context.Context, ref TaskRef, opts GetOptions) (*TaskDetails, error) {
	resp, err := c.getTask(ctx, ref, opts)
	if err != nil {
		return nil, err
	}
	return &TaskDetails{Task: resp.GetTask(), Attempts: resp.GetAttempts(), Children: resp.GetChildren()}, nil
}

func (c *Client) getTask(ctx context.Context, ref TaskRef, opts GetOptions) (*cronoqv1.GetTaskResponse, error) {
	r, err := ref.proto()
	if err != nil {
		return nil, err
	}
	req := &cronoqv1.GetTaskRequest{
		Task: r, IncludeAttempts: opts.IncludeAttempts,
		IncludeChildren: opts.IncludeChildren, IncludeDependencyResults: opts.IncludeDependencyResults,
	}
	var resp *cronoqv1.GetTaskResponse
	err = c.conn.invoke(ctx, "GetTask", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).GetTask(ctx, req, opts...)
		return err
	})
	return resp, err
}

// TaskWithAttempts is a GetWithAttempts's answer: the task and its attempts, oldest first
// (one running now is last, with outcome AttemptOutcomeRunning and no EndedAt).
type TaskWithAttempts struct {
	Task     *Task
	Attempts []*Attempt
}

// GetWithAttempts reads one task with the history of its attempts (Get without it).
func (c *Client) GetWithAttempts(ctx context.Context, ref TaskRef) (*TaskWithAttempts, error) {
	resp, err := c.getTask(ctx, ref, GetOptions{IncludeAttempts: true})
	if err != nil {
		return nil, err
	}
	return &TaskWithAttempts{Task: resp.GetTask(), Attempts: resp.GetAttempts()}, nil
}

// Waited is a Wait's answer: the task, and whether it is terminal.
type Waited struct {
	Task *Task
	Done bool
}

// Wait blocks until the task is terminal or timeout passes (then Done is false).
func (c *Client) Wait(ctx context.Context, ref TaskRef, timeout time.Duration) (*Waited, error) {
	r, err := ref.proto()
	if err != nil {
		return nil, err
	}
	ms := uint32(min(max(timeout.Milliseconds(), 1), 1<<31))
	var resp *cronoqv1.WaitTaskResponse
	err = c.conn.invoke(ctx, "WaitTask", timeout+c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).WaitTask(ctx, &cronoqv1.WaitTaskRequest{Task: r, TimeoutMs: ms}, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Waited{Task: resp.GetTask(), Done: resp.GetDone()}, nil
}

// Cancel requests the task's cancellation and returns it.
func (c *Client) Cancel(ctx context.Context, ref TaskRef) (*Task, error) {
	cancelled, err := c.CancelWith(ctx, ref, CancelOptions{})
	if err != nil {
		return nil, err
	}
	return cancelled.Task, nil
}

// CancelOptions: IncludeDescendants also cancels the tasks its handler spawned, theirs, and
// so on, with the tasks that depend on any of them, in one transaction; one in a pool the
// caller may not cancel is left as it is.
type CancelOptions struct {
	IncludeDescendants bool
}

// Cancelled is a CancelWith's answer.
type Cancelled struct {
	Task *Task
	// DescendantsCancelled: with IncludeDescendants, how many of its descendants this call
	// cancelled (or asked to stop, when running).
	DescendantsCancelled int64
}

// CancelWith requests the task's cancellation, and its descendants' with IncludeDescendants.
func (c *Client) CancelWith(ctx context.Context, ref TaskRef, opts CancelOptions) (*Cancelled, error) {
	r, err := ref.proto()
	if err != nil {
		return nil, err
	}
	req := &cronoqv1.CancelTaskRequest{Task: r, IncludeDescendants: opts.IncludeDescendants}
	var resp *cronoqv1.CancelTaskResponse
	err = c.conn.invoke(ctx, "CancelTask", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, callOpts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).CancelTask(ctx, req, callOpts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Cancelled{Task: resp.GetTask(), DescendantsCancelled: resp.GetDescendantsCancelled()}, nil
}

// RetryOptions say when a retried task may run again and how many attempts it gets.
type RetryOptions struct {
	// RunAt: not before this time; Delay: not before now + Delay (RunAt wins when both are
	// set); neither: now.
	RunAt time.Time
	Delay time.Duration
	// ExtraAttempts: how many more attempts a task that used all of its attempts gets
	// (0 to 1000; 0: 1). A task with attempts left keeps them.
	ExtraAttempts int32
}

// Retried is a Retry's answer.
type Retried struct {
	// Task: PENDING again, its attempts kept.
	Task *Task
	// DependentsRestored: how many of its dependents, ended because it ended, wait for it again.
	DependentsRestored int64
}

// Retry puts a FAILED or CANCELLED task back to PENDING, keeping its attempts and their
// history. Another state is FAILED_PRECONDITION.
func (c *Client) Retry(ctx context.Context, ref TaskRef, opts RetryOptions) (*Retried, error) {
	r, err := ref.proto()
	if err != nil {
		return nil, err
	}
	req := &cronoqv1.RetryTaskRequest{Task: r, RunAt: runAt(opts.RunAt, opts.Delay), ExtraAttempts: opts.ExtraAttempts}
	var resp *cronoqv1.RetryTaskResponse
	err = c.conn.invoke(ctx, "RetryTask", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, callOpts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).RetryTask(ctx, req, callOpts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Retried{Task: resp.GetTask(), DependentsRestored: resp.GetDependentsRestored()}, nil
}

// Delete deletes an ended task (SUCCEEDED, FAILED, CANCELLED or EXPIRED) with its attempts
// and events, and returns its id. An unfinished task is FAILED_PRECONDITION (Cancel it first).
func (c *Client) Delete(ctx context.Context, ref TaskRef) (uint64, error) {
	r, err := ref.proto()
	if err != nil {
		return 0, err
	}
	var resp *cronoqv1.DeleteTaskResponse
	err = c.conn.invoke(ctx, "DeleteTask", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).DeleteTask(ctx, &cronoqv1.DeleteTaskRequest{Task: r}, opts...)
		return err
	})
	return resp.GetId(), err
}

// TaskFilter selects the tasks of a bulk action: those that match every field set. An
// unset field matches every task.
type TaskFilter struct {
	// Pool: empty for every pool the caller may act on.
	Pool string
	// States: empty for every state the action applies to (cancel: PENDING, BLOCKED,
	// RUNNING; retry: FAILED, CANCELLED; delete: SUCCEEDED, FAILED, CANCELLED, EXPIRED); a state
	// outside those is refused.
	States []TaskState
	// Created and finished within these bounds (a zero time: no bound).
	CreatedAfter, CreatedBefore   time.Time
	FinishedAfter, FinishedBefore time.Time
	// KeyPrefix: tasks whose key starts with this (at most 256 bytes).
	KeyPrefix string
	// ErrorContains: tasks whose error contains this text, case-sensitive (at most 1024 bytes).
	ErrorContains string
	// IDs: only these tasks (at most 1000).
	IDs []uint64
	// ParentID: only the tasks this task's handler spawned (0: no bound).
	ParentID uint64
}

func (f TaskFilter) proto() *cronoqv1.TaskFilter {
	timestamp := func(t time.Time) *timestamppb.Timestamp {
		if t.IsZero() {
			return nil
		}
		return timestamppb.New(t)
	}
	return &cronoqv1.TaskFilter{
		Pool:           f.Pool,
		States:         f.States,
		CreatedAfter:   timestamp(f.CreatedAfter),
		CreatedBefore:  timestamp(f.CreatedBefore),
		FinishedAfter:  timestamp(f.FinishedAfter),
		FinishedBefore: timestamp(f.FinishedBefore),
		KeyPrefix:      f.KeyPrefix,
		ErrorContains:  f.ErrorContains,
		Ids:            f.IDs,
		ParentId:       f.ParentID,
	}
}

// BulkOptions: DryRun counts the tasks that match and changes nothing (Changed is 0).
type BulkOptions struct {
	DryRun bool
}

// BulkRetryOptions are RetryTasks's: DryRun, and RetryOptions applied to every task retried.
type BulkRetryOptions struct {
	DryRun bool
	RetryOptions
}

// BulkResult is what a bulk action did: in total, per shard, and the shards that could
// not be reached (their tasks are neither matched nor changed: run it again later).
type BulkResult struct {
	// Matched: tasks that matched the filter; Changed: those the action changed (a task
	// that changed meanwhile is matched, not changed).
	Matched, Changed  int64
	Shards            []*BulkShardResult
	UnavailableShards []string
	// Incomplete: some shard stopped at its time bound before the end of the matching tasks
	// (its BulkShardResult says so); what it did is counted. The same call again continues.
	Incomplete bool
}

// bulkResponse is what the three bulk responses share.
type bulkResponse interface {
	GetMatched() int64
	GetChanged() int64
	GetShards() []*cronoqv1.BulkShardResult
	GetUnavailableShards() []string
	GetIncomplete() bool
}

// bulkCall runs one bulk action (its call on the TaskService) with the retries of every call.
func bulkCall[R bulkResponse](ctx context.Context, c *Client, what string,
	call func(context.Context, cronoqv1.TaskServiceClient, ...grpc.CallOption) (R, error),
) (*BulkResult, error) {
	var resp R
	err := c.conn.invoke(ctx, what, c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = call(ctx, cronoqv1.NewTaskServiceClient(cc), opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &BulkResult{
		Matched:           resp.GetMatched(),
		Changed:           resp.GetChanged(),
		Shards:            resp.GetShards(),
		UnavailableShards: resp.GetUnavailableShards(),
		Incomplete:        resp.GetIncomplete(),
	}, nil
}

// CancelTasks requests the cancellation of the unfinished tasks that match filter, in
// every shard.
func (c *Client) CancelTasks(ctx context.Context, filter TaskFilter, opts BulkOptions) (*BulkResult, error) {
	req := &cronoqv1.CancelTasksRequest{Filter: filter.proto(), DryRun: opts.DryRun}
	return bulkCall(ctx, c, "CancelTasks", func(ctx context.Context, tc cronoqv1.TaskServiceClient, callOpts ...grpc.CallOption) (*cronoqv1.CancelTasksResponse, error) {
		return tc.CancelTasks(ctx, req, callOpts...)
	})
}

// RetryTasks retries the FAILED and CANCELLED tasks that match filter, in every shard, as
// Retry does.
func (c *Client) RetryTasks(ctx context.Context, filter TaskFilter, opts BulkRetryOptions) (*BulkResult, error) {
	req := &cronoqv1.RetryTasksRequest{
		Filter: filter.proto(), DryRun: opts.DryRun, RunAt: runAt(opts.RunAt, opts.Delay), ExtraAttempts: opts.ExtraAttempts,
	}
	return bulkCall(ctx, c, "RetryTasks", func(ctx context.Context, tc cronoqv1.TaskServiceClient, callOpts ...grpc.CallOption) (*cronoqv1.RetryTasksResponse, error) {
		return tc.RetryTasks(ctx, req, callOpts...)
	})
}

// DeleteTasks deletes the ended tasks that match filter, in every shard, as Delete does.
func (c *Client) DeleteTasks(ctx context.Context, filter TaskFilter, opts BulkOptions) (*BulkResult, error) {
	req := &cronoqv1.DeleteTasksRequest{Filter: filter.proto(), DryRun: opts.DryRun}
	return bulkCall(ctx, c, "DeleteTasks", func(ctx context.Context, tc cronoqv1.TaskServiceClient, callOpts ...grpc.CallOption) (*cronoqv1.DeleteTasksResponse, error) {
		return tc.DeleteTasks(ctx, req, callOpts...)
	})
}

// PausePool pauses a pool: it still accepts submissions and schedule fires, but nothing
// of it is leased until ResumePool; its running tasks finish normally. The pause is stored
// (it holds across restarts and failovers). An unknown pool is INVALID_ARGUMENT.
func (c *Client) PausePool(ctx context.Context, pool string) (*PoolPause, error) {
	var resp *cronoqv1.PausePoolResponse
	err := c.conn.invoke(ctx, "PausePool", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewAdminServiceClient(cc).PausePool(ctx, &cronoqv1.PausePoolRequest{Pool: pool}, opts...)
		return err
	})
	return resp.GetPause(), err
}

// ResumePool lets a paused pool's tasks be leased again.
func (c *Client) ResumePool(ctx context.Context, pool string) (*PoolPause, error) {
	var resp *cronoqv1.ResumePoolResponse
	err := c.conn.invoke(ctx, "ResumePool", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewAdminServiceClient(cc).ResumePool(ctx, &cronoqv1.ResumePoolRequest{Pool: pool}, opts...)
		return err
	})
	return resp.GetPause(), err
}

// ListWorkers lists the registered workers of pool, or of every pool the caller may read when
// pool is empty, from every shard; the shards that could not be asked are in UnavailableShards.
func (c *Client) ListWorkers(ctx context.Context, pool string) (*cronoqv1.ListWorkersResponse, error) {
	var resp *cronoqv1.ListWorkersResponse
	err := c.conn.invoke(ctx, "ListWorkers", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewWorkerServiceClient(cc).ListWorkers(ctx, &cronoqv1.ListWorkersRequest{Pool: pool}, opts...)
		return err
	})
	return resp, err
}

// ScheduleSpec is one cron schedule: (Pool, Name) names it, and every task it fires takes
// Payload and the options below, as a TaskSpec's.
type ScheduleSpec struct {
	Pool string
	Name string
	// Cron: five fields (minute hour day-of-month month day-of-week), or six with seconds
	// first ("*/5 * * * * *": every five seconds); the server parses it.
	Cron string
	// Timezone: an IANA zone name ("Europe/Paris"); "" is UTC.
	Timezone string
	// Payload: []byte as it is, anything else as JSON (see EncodePayload).
	Payload  any
	Priority int32
	// MaxAttempts: 0 takes the pool's default.
	MaxAttempts int32
	Resources   map[string]int64
	// Timeout of each attempt of a fired task (capped by the pool's); 0: the pool's.
	Timeout time.Duration
	// GroupKey: the group of each fired task (TaskSpec.GroupKey); "": none.
	GroupKey string
	// Paused: stored, but fires nothing until put again unpaused.
	Paused bool
	// FireAllMissed: after downtime, fire every missed slot rather than only the latest.
	FireAllMissed bool
	// Trace: the trace context the schedule keeps (each fired task links to it); nil: the
	// current span's context of PutSchedule's ctx, as Submit sends.
	Trace *cronoqv1.TraceContext
}

func (s ScheduleSpec) proto(ctx context.Context) (*cronoqv1.Schedule, error) {
	data, contentType, err := encodePayloadArg(s.Payload)
	if err != nil {
		return nil, err
	}
	trace := s.Trace
	if trace == nil {
		trace = traceContext(ctx)
	}
	return &cronoqv1.Schedule{
		Pool:          s.Pool,
		Name:          s.Name,
		Cron:          s.Cron,
		Timezone:      s.Timezone,
		Payload:       data,
		ContentType:   contentType,
		Priority:      s.Priority,
		MaxAttempts:   s.MaxAttempts,
		Resources:     s.Resources,
		TimeoutMs:     milliseconds(s.Timeout), // a negative one is sent, for the server to name it
		GroupKey:      s.GroupKey,
		Paused:        s.Paused,
		FireAllMissed: s.FireAllMissed,
		Trace:         trace,
	}, nil
}

// PutSchedule creates or replaces the schedule (spec.Pool, spec.Name) and returns it as
// stored, with its NextFireAt. A cron, time zone or option the server refuses is
// ErrInvalidArgument, and nothing is stored.
func (c *Client) PutSchedule(ctx context.Context, spec ScheduleSpec) (*Schedule, error) {
	schedule, err := spec.proto(ctx)
	if err != nil {
		return nil, err
	}
	var resp *cronoqv1.PutScheduleResponse
	err = c.conn.invoke(ctx, "PutSchedule", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewScheduleServiceClient(cc).PutSchedule(ctx, &cronoqv1.PutScheduleRequest{Schedule: schedule}, opts...)
		return err
	})
	return resp.GetSchedule(), err
}

// DeleteSchedule deletes the schedule (pool, name); the tasks it fired stay. A missing
// schedule is ErrNotFound (so is a retry after UNAVAILABLE whose first attempt deleted it).
func (c *Client) DeleteSchedule(ctx context.Context, pool, name string) error {
	return c.conn.invoke(ctx, "DeleteSchedule", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
		_, err := cronoqv1.NewScheduleServiceClient(cc).DeleteSchedule(ctx, &cronoqv1.DeleteScheduleRequest{Pool: pool, Name: name}, opts...)
		return err
	})
}

// ListSchedules lists the schedules of pool, or of every pool the caller may read when pool
// is empty, from every shard; the shards that could not be asked are in UnavailableShards.
func (c *Client) ListSchedules(ctx context.Context, pool string) (*cronoqv1.ListSchedulesResponse, error) {
	var resp *cronoqv1.ListSchedulesResponse
	err := c.conn.invoke(ctx, "ListSchedules", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewScheduleServiceClient(cc).ListSchedules(ctx, &cronoqv1.ListSchedulesRequest{Pool: pool}, opts...)
		return err
	})
	return resp, err
}

// Snapshot is every shard's state: its leader and term, standbys, task counts by pool and
// state, resources, workers, recent activity and outboxes (UnavailableShards: those that
// could not be asked).
func (c *Client) Snapshot(ctx context.Context) (*cronoqv1.GetSnapshotResponse, error) {
	var resp *cronoqv1.GetSnapshotResponse
	err := c.conn.invoke(ctx, "GetSnapshot", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewAdminServiceClient(cc).GetSnapshot(ctx, &cronoqv1.GetSnapshotRequest{}, opts...)
		return err
	})
	return resp, err
}

// ServerInfo is about the server this client talks to: its version, shard, role (a standby
// answers too), leader and term, and who the caller is to it.
func (c *Client) ServerInfo(ctx context.Context) (*cronoqv1.GetServerInfoResponse, error) {
	var resp *cronoqv1.GetServerInfoResponse
	err := c.conn.invoke(ctx, "GetServerInfo", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewAdminServiceClient(cc).GetServerInfo(ctx, &cronoqv1.GetServerInfoRequest{}, opts...)
		return err
	})
	return resp, err
}

// ListOptions select a page of tasks.
type ListOptions struct {
	// Pool: empty for every pool the caller may read.
	Pool string
	// State: 0 for every state.
	State TaskState
	// PageSize: 100 when 0.
	PageSize int32
	// PageToken: the previous page's NextPageToken.
	PageToken string
	// Filter: only the tasks that match it, as a bulk action matches them (any state may be
	// named); nil for every task.
	Filter *TaskFilter
}

// List returns one page of tasks in id order; pass its NextPageToken for the next.
func (c *Client) List(ctx context.Context, opts ListOptions) (*cronoqv1.ListTasksResponse, error) {
	if opts.PageSize == 0 {
		opts.PageSize = 100
	}
	req := &cronoqv1.ListTasksRequest{Pool: opts.Pool, State: opts.State, PageSize: opts.PageSize, PageToken: opts.PageToken}
	if opts.Filter != nil {
		req.Filter = opts.Filter.proto()
	}
	var resp *cronoqv1.ListTasksResponse
	err := c.conn.invoke(ctx, "ListTasks", c.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, callOpts ...grpc.CallOption) (err error) {
		resp, err = cronoqv1.NewTaskServiceClient(cc).ListTasks(ctx, req, callOpts...)
		return err
	})
	return resp, err
}

// WatchOptions select the events of Watch.
type WatchOptions struct {
	// Pool: empty for every pool the caller may read.
	Pool string
	// Cursor: start after that event (a TaskEvent's Cursor) instead of live.
	Cursor string
	// IncludePayloads: events carry tasks' payloads and results.
	IncludePayloads bool
	// NoResume: end with the stream (and its error) instead of opening it again.
	NoResume bool
	// OnReconnect, when set, is called before each reconnection with the error that ended
	// the stream (nil when the server ended it cleanly) and the cursor it resumes from.
	OnReconnect func(err error, cursor string)
}

// watchStartKey: a sharded server's initial metadata (and trailers) name where a live
// stream starts, so a stream that breaks before its first event resumes from there.
const watchStartKey = "cronoq-watch-cursor"

// Watch streams task events as they happen. Unless NoResume, a stream that ends or
// breaks (a restart or drain, a new leader, UNAVAILABLE, or ABORTED because the watcher
// fell behind) is opened again from the last event's cursor, through the endpoint rules of
// every call: the events in between are replayed, and one seen already is skipped. A row of
// failures with no event is given up after Retry.MaxElapsed; other errors (PERMISSION_DENIED,
// OUT_OF_RANGE for a cursor the server no longer keeps, ...) end the iteration at once.
// Break out of the loop, or cancel ctx, to stop watching.
//
//	for event, err := range client.Watch(ctx, cronoq.WatchOptions{Pool: "default"}) {
//		if err != nil { return err }
//		fmt.Println(event.GetTask().GetId(), event.GetTask().GetState())
//	}
func (c *Client) Watch(ctx context.Context, opts WatchOptions) iter.Seq2[*cronoqv1.TaskEvent, error] {
	return func(yield func(*cronoqv1.TaskEvent, error) bool) {
		cursor := opts.Cursor
		lastSeq := map[string]uint64{} // shard -> the seq of the last event yielded
		var failingSince time.Time
		failures := 0
		for {
			opened := time.Now()
			stop, err := c.watchOnce(ctx, opts, &cursor, lastSeq, yield, &failingSince, &failures)
			if stop {
				return
			}
			if ctx.Err() != nil {
				yield(nil, ctx.Err())
				return
			}
			transient := err == nil || errors.Is(err, ErrUnavailable) || errors.Is(err, ErrCancelled) ||
				errors.Is(err, ErrAborted) || errors.Is(err, ErrInternal)
			if opts.NoResume || !transient {
				if err != nil {
					yield(nil, err)
				}
				return
			}
			now := time.Now()
			if now.Sub(opened) >= healthyStream {
				failingSince, failures = time.Time{}, 0
			}
			if failingSince.IsZero() {
				failingSince = now
			}
			if c.conn.retry.MaxElapsed > 0 && now.Sub(failingSince) >= c.conn.retry.MaxElapsed {
				if err == nil {
					err = newError(codes.Unavailable, kindCode, "watch: the server kept ending the stream for %v", c.conn.retry.MaxElapsed)
				}
				yield(nil, err)
				return
			}
			if errors.Is(err, ErrUnavailable) || errors.Is(err, ErrCancelled) {
				c.conn.onUnavailable(err) // to the leader a standby names, or the next endpoint
			}
			c.conn.log.Info("cronoq: watch stream ended; reconnecting", "error", err, "endpoint", c.conn.endpoint().String())
			if opts.OnReconnect != nil {
				opts.OnReconnect(err, cursor)
			}
			if sleep(ctx, c.conn.retry.Backoff(failures)) != nil {
				yield(nil, ctx.Err())
				return
			}
			failures++
		}
	}
}

// watchOnce runs one Watch stream; stop: the caller broke out of its loop.
func (c *Client) watchOnce(ctx context.Context, opts WatchOptions, cursor *string, lastSeq map[string]uint64,
	yield func(*cronoqv1.TaskEvent, error) bool, failingSince *time.Time, failures *int,
) (stop bool, err error) {
	cc, ep, err := c.conn.channel()
	if err != nil {
		return false, err
	}
	sctx, cancel := context.WithCancel(c.conn.outgoing(ctx))
	defer cancel() // a caller that stops early closes the stream
	req := &cronoqv1.WatchRequest{Pool: opts.Pool, IncludePayloads: opts.IncludePayloads, Cursor: *cursor}
	stream, err := cronoqv1.NewTaskServiceClient(cc).Watch(sctx, req)
	if err != nil {
		return false, c.conn.diagnose(ep, fromGRPC(err, nil))
	}
	if *cursor == "" {
		if header, herr := stream.Header(); herr == nil && len(header.Get(watchStartKey)) > 0 {
			*cursor = header.Get(watchStartKey)[0]
		}
	}
	received := false
	for {
		resp, rerr := stream.Recv()
		if rerr != nil {
			if *cursor == "" { // a call that ended at once: the server repeats the start in its trailers
				if v := stream.Trailer().Get(watchStartKey); len(v) > 0 {
					*cursor = v[0]
				}
			}
			if rerr == io.EOF {
				return false, nil
			}
			err := fromGRPC(rerr, stream.Trailer())
			if !received {
				err = c.conn.diagnose(ep, err)
			}
			return false, err
		}
		event := resp.GetEvent()
		received, *failingSince, *failures = true, time.Time{}, 0
		if event.GetCursor() != "" {
			*cursor = event.GetCursor()
		}
		if seq := event.GetSeq(); seq != 0 {
			if seq <= lastSeq[event.GetShard()] {
				continue // replayed after a reconnect, and yielded before it
			}
			lastSeq[event.GetShard()] = seq
		}
		if !yield(event, nil) {
			return true, nil
		}
	}
}
