package cronoq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// Handler runs one attempt of a task. Its result is stored as EncodePayload stores a
// payload ([]byte as it is, anything else as JSON). An error fails the attempt, retried
// with backoff while attempts remain unless it is NonRetryable; RetryAfter sets the delay.
// Snooze puts the task off without counting the attempt. TaskContextFrom(ctx) reports the
// handler's progress and saves its checkpoint.
//
// ctx is cancelled when the task's cancellation is requested (context.Cause(ctx) is
// ErrTaskCancelled: the task ends CANCELLED), when its timeout passes, when its lease is
// lost, or when the worker stops and the shutdown grace has passed (ErrWorkerStopping: the
// task is given back to the server unfinished).
type Handler func(ctx context.Context, task *Task) (any, error)

// Why a handler's context was cancelled (context.Cause).
var (
	ErrTaskCancelled  = errors.New("cronoq: the task's cancellation was requested")
	ErrWorkerStopping = errors.New("cronoq: the worker is stopping and its shutdown grace has passed")
	ErrLeaseLost      = errors.New("cronoq: the task is no longer leased to this worker")
	ErrTaskTimeout    = errors.New("cronoq: the attempt's timeout passed")
)

// TaskError is a handler's error that says how the attempt fails: NonRetryable or RetryAfter.
type TaskError struct {
	Err error
	// Retryable: false ends the task FAILED whatever attempts remain.
	Retryable bool
	// RetryAfter overrides the pool's backoff before the next attempt when > 0.
	RetryAfter time.Duration
}

// Error is the wrapped error's message.
func (e *TaskError) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error, for errors.Is and errors.As.
func (e *TaskError) Unwrap() error { return e.Err }

// NonRetryable fails the attempt and the task, whatever attempts remain.
func NonRetryable(err error) error { return &TaskError{Err: err} }

// RetryAfter fails the attempt; the next one starts no sooner than after d.
func RetryAfter(err error, d time.Duration) error {
	return &TaskError{Err: err, Retryable: true, RetryAfter: d}
}

// SnoozeError is a handler's error that snoozes the task: not now, again in Duration. The
// task is PENDING again, due then, and the attempt is not counted (Task.snoozes grows by
// one). Snooze returns one; errors.As finds it when wrapped.
type SnoozeError struct {
	// Duration: 0 (due at once) to 4,294,967,295 ms (about 49.7 days), rounded down to whole ms.
	Duration time.Duration
	// Reason is kept in the task's history.
	Reason string
}

// Error says for how long, and why when a reason is given.
func (e *SnoozeError) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("snoozed for %v", e.Duration)
	}
	return fmt.Sprintf("snoozed for %v: %s", e.Duration, e.Reason)
}

// Snooze puts the task off for d (rounded down to whole ms): return it from the handler. A
// task snoozed as often as its pool's max_snoozes (100 by default) has the snooze taken as a
// retryable failure instead. A d that is negative or over 4,294,967,295 ms, or a reason that
// is not UTF-8, gives an ErrInvalidArgument error instead, which fails the attempt.
func Snooze(d time.Duration, reason string) error {
	if _, err := snoozeMs(d, reason); err != nil {
		return err
	}
	return &SnoozeError{Duration: d, Reason: reason}
}

// snoozeMs is a snooze's snooze_ms, or why it cannot be sent.
func snoozeMs(d time.Duration, reason string) (uint32, error) {
	switch {
	case d < 0:
		return 0, newError(codes.InvalidArgument, kindCode, "snooze: %v is negative", d)
	case d.Milliseconds() > math.MaxUint32:
		return 0, newError(codes.InvalidArgument, kindCode, "snooze: %v is more than %d ms", d, uint32(math.MaxUint32))
	case !utf8.ValidString(reason):
		return 0, newError(codes.InvalidArgument, kindCode, "snooze: the reason is not valid UTF-8")
	}
	return uint32(d.Milliseconds()), nil
}

// WorkerOptions configure a Worker.
type WorkerOptions struct {
	Options
	// Pools the worker runs tasks of (required).
	Pools []string
	// Concurrency: the most handlers running at once; 16 when 0.
	Concurrency int
	// Prefetch: how many leased tasks the worker may hold, not yet started, beyond the ones
	// its handlers run, so a handler that ends starts the next task without a round trip to
	// the server. A held task's lease and timeout run while it waits. When 0, 4 tasks a slot
	// (fewer when Concurrency + Prefetch would pass 100,000); NoPrefetch: none. The server
	// sends beyond the free slots only what the worker starts within about a step, so a
	// worker with slow handlers holds nothing another worker could start.
	Prefetch int
	// Name shown by ListWorkers; hostname-pid when empty.
	Name   string
	Labels map[string]string
	// ShutdownGrace: how long running tasks may go on once the worker stops; those still
	// running then are cancelled and given back to the server. 30 s when 0.
	ShutdownGrace time.Duration
	// FinishLinger: how long an outcome waits for others to join its report while handlers
	// run; 2 ms when 0, none when negative.
	FinishLinger time.Duration
}

// NoPrefetch as WorkerOptions.Prefetch: the worker holds no task beyond the ones its handlers run.
const NoPrefetch = -1

const (
	maxFinishBatch        = 1000
	mib                   = 1 << 20
	defaultMaxResultBytes = 4 * mib
	defaultMaxLeaseBytes  = 16 * mib
	// A checkpoint larger is refused (RegisterWorkerResponse.max_checkpoint_bytes, when 0).
	defaultMaxCheckpointBytes = 256 << 10
	// Room left under MaxMessageBytes for what a message carries besides tasks or outcomes.
	maxRequestBytes = MaxMessageBytes - mib
	minLeaseBytes   = mib
	framing         = 16 // a message's tag and length prefix, and its parent's
	releaseReason   = "worker shut down"
	// The most tasks a worker holds (Concurrency + Prefetch): the credits a Work stream may carry.
	maxHeld = 100_000
	// The default prefetch, in tasks a slot (at concurrency 64 on PostgreSQL, no-op tasks:
	// prefetch 64 drains at 0.8x prefetch 256, and 1,024 no faster than 256).
	prefetchPerSlot = 4
	// After the shutdown grace: how long cancelled handlers get to return, and the time left
	// (from the end of the grace) for them and for the last reports.
	unwindTime        = time.Second
	stopExtraTime     = 3 * time.Second
	deregisterTimeout = 2 * time.Second
)

// Worker registers with the shard of its pools and runs their tasks over one Work stream:
// credits for its free slots (never more tasks than its concurrency plus its prefetch, never
// more handlers running than its concurrency), outcomes batched, heartbeats naming the
// attempts it holds, the stream opened again after a failure, and a graceful stop that gives
// unfinished tasks back. Create it with NewWorker; Run it once.
type Worker struct {
	opts    WorkerOptions
	handler Handler
	conn    *connection
	log     *slog.Logger

	started  atomic.Bool
	tasks    context.Context // the handlers' parent: Run's context, without its cancellation
	stopOnce sync.Once
	stopCh   chan struct{}
	wake     chan struct{} // the sender has something to send

	mu             sync.Mutex
	workerID       string
	heartbeat      time.Duration
	maxResultBytes int
	maxLeaseBytes  uint64
	leaseBytes     uint64
	maxCheckpoint  int
	running        map[uint64]*runningTask
	held           []heldTask              // prefetched, not yet started: oldest first
	unacked        map[uint64]sentOutcome  // reported, not yet answered
	outcomes       []*cronoqv1.TaskOutcome // not yet sent on the current stream
	freed          uint32                  // tasks that left the worker, not yet given back as credits
	beatDue        bool
	reports        uint64 // the handlers' reports so far: each is a version
	beatsSent      uint64 // heartbeats sent on the current stream
	beatsAnswered  uint64 // and answered
	stopping       bool
	closed         bool // the current stream's side is closed: nothing more can be reported
	processed      int64
}

type runningTask struct {
	attempt         int32
	pool            string
	cancel          context.CancelCauseFunc
	done            chan struct{}
	cancelRequested bool // the server asked: report it cancelled
	releasing       bool // cancelled at shutdown: give it back
	lost            bool // no longer ours: report nothing
	// The task's checkpoint, as leased, then as the handler saved it (nil: none); and what
	// the handler reported that the server has not acknowledged (a checkpoint saved empty
	// clears the task's).
	checkpoint []byte
	progress   pending[*cronoqv1.TaskProgress]
	saved      pending[[]byte]
	spawned    []*cronoqv1.SubmitTaskRequest // sent with its success only
}

// sentOutcome is an outcome reported and not yet answered, and its task's pool (for the logs).
type sentOutcome struct {
	outcome *cronoqv1.TaskOutcome
	pool    string
}

// heldTask is a prefetched task waiting for a handler slot.
type heldTask struct {
	task     *Task
	received time.Time // its timeout counts from here
}

// defaultPrefetch is a worker's prefetch when none is given: prefetchPerSlot tasks a slot,
// fewer when both would pass maxHeld.
func defaultPrefetch(concurrency int) int {
	return min(prefetchPerSlot*concurrency, maxHeld-concurrency)
}

// NewWorker checks the options and returns a worker that runs handler.
func NewWorker(opts WorkerOptions, handler Handler) (*Worker, error) {
	opts.Options = opts.Options.withDefaults()
	if len(opts.Pools) == 0 {
		return nil, newError(codes.InvalidArgument, kindCode, "pools: give at least one pool")
	}
	if opts.Concurrency < 0 {
		return nil, newError(codes.InvalidArgument, kindCode, "concurrency: %d must be at least 1", opts.Concurrency)
	}
	if opts.Concurrency == 0 {
		opts.Concurrency = 16
	}
	if opts.Prefetch < NoPrefetch || opts.Concurrency+max(opts.Prefetch, 0) > maxHeld {
		return nil, newError(codes.InvalidArgument, kindCode,
			"prefetch: %d must be at least 0 (or NoPrefetch), and concurrency (%d) + prefetch at most %d",
			opts.Prefetch, opts.Concurrency, maxHeld)
	}
	switch opts.Prefetch {
	case 0:
		opts.Prefetch = defaultPrefetch(opts.Concurrency)
	case NoPrefetch:
		opts.Prefetch = 0
	}
	if handler == nil {
		return nil, newError(codes.InvalidArgument, kindCode, "handler: give a Handler")
	}
	if opts.Name == "" {
		host, _ := os.Hostname()
		opts.Name = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	if opts.ShutdownGrace <= 0 {
		opts.ShutdownGrace = 30 * time.Second
	}
	if opts.FinishLinger == 0 {
		opts.FinishLinger = 2 * time.Millisecond
	}
	conn, err := newConnection(&opts.Options)
	if err != nil {
		return nil, err
	}
	return &Worker{
		opts:           opts,
		handler:        handler,
		conn:           conn,
		log:            opts.logger(),
		stopCh:         make(chan struct{}),
		wake:           make(chan struct{}, 1),
		heartbeat:      10 * time.Second,
		maxResultBytes: defaultMaxResultBytes,
		maxLeaseBytes:  defaultMaxLeaseBytes,
		leaseBytes:     defaultMaxLeaseBytes,
		maxCheckpoint:  defaultMaxCheckpointBytes,
		running:        map[uint64]*runningTask{},
		unacked:        map[uint64]sentOutcome{},
	}, nil
}

// Endpoint is the server the worker talks to now.
func (w *Worker) Endpoint() Endpoint { return w.conn.endpoint() }

// ID is the worker id the server gave at registration ("" before).
func (w *Worker) ID() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.workerID
}

// Processed is the number of outcomes the server has acknowledged.
func (w *Worker) Processed() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.processed
}

// Stop asks the worker to stop taking tasks; Run returns once running tasks have finished
// (within ShutdownGrace; the others are given back) and every outcome is reported.
func (w *Worker) Stop() { w.stopOnce.Do(func() { close(w.stopCh) }) }

func (w *Worker) notify() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Run registers and runs tasks until ctx is done or Stop is called, then stops
// gracefully and returns nil. It returns an error when the worker cannot go on: a
// refusal of its credentials, a TLS failure, a redirect refused or too many redirects.
// It runs at most once per Worker.
func (w *Worker) Run(ctx context.Context) error {
	if !w.started.CompareAndSwap(false, true) {
		return newError(codes.FailedPrecondition, kindCode, "worker: Run was called already")
	}
	defer w.conn.close()
	runDone := make(chan struct{})
	defer close(runDone)
	go func() {
		select {
		case <-ctx.Done():
			w.Stop()
		case <-runDone:
		}
	}()
	// The worker's own calls outlive ctx, for the bounded time of a graceful stop.
	calls, cancelCalls := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelCalls()

	if err := w.register(calls); err != nil {
		return err
	}
	if w.stopRequested() { // stopped while registering
		w.deregister(context.WithoutCancel(ctx))
		return nil
	}
	w.logFor(w.ID()).Info("cronoq: worker registered", "endpoint", w.Endpoint().String(), "pools", w.opts.Pools)

	heartbeats, stopHeartbeats := context.WithCancel(calls)
	defer stopHeartbeats()
	go w.heartbeatLoop(heartbeats)

	w.tasks = context.WithoutCancel(ctx)
	var workErr error
	workDone := make(chan struct{})
	go func() {
		defer close(workDone)
		workErr = w.workLoop(calls)
	}()
	select {
	case <-workDone:
	case <-w.stopCh:
	}
	w.mu.Lock()
	w.stopping = true // also when the stream failed for good: unfinished tasks are released
	w.releaseHeld()
	w.mu.Unlock()
	w.notify()
	w.finishRunning(workDone, cancelCalls)
	stopHeartbeats()
	w.deregister(context.WithoutCancel(ctx))
	return workErr
}

func (w *Worker) stopRequested() bool {
	select {
	case <-w.stopCh:
		return true
	default:
		return false
	}
}

// register registers with the shard of the worker's pools, following up to 3 redirects in
// a row; UNAVAILABLE is retried (on the leader named, or the next configured endpoint)
// until Stop. It returns nil without registering when stopped first.
func (w *Worker) register(calls context.Context) error {
	ctx, cancel := context.WithCancel(calls)
	defer cancel()
	go func() {
		select {
		case <-w.stopCh:
			cancel()
		case <-ctx.Done():
		}
	}()
	redirects := 0
	row := failureRow{retry: w.conn.retry, log: w.logger, what: "worker registration"}
	chain := []string{w.conn.endpoint().String()} // where it went, and where each server sent it
	req := &cronoqv1.RegisterWorkerRequest{
		Name: w.opts.Name, Pools: w.opts.Pools, Concurrency: int32(w.opts.Concurrency), Labels: w.opts.Labels,
	}
	for {
		var resp *cronoqv1.RegisterWorkerResponse
		err := w.conn.once(ctx, w.conn.timeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) (err error) {
			resp, err = cronoqv1.NewWorkerServiceClient(cc).RegisterWorker(ctx, req, opts...)
			return err
		})
		if w.stopRequested() {
			return nil
		}
		var e *Error
		switch {
		case err == nil:
			row.succeeded()
			w.registered(resp)
			return nil
		case errors.Is(err, ErrFailedPrecondition) && asError(err, &e) && e.ShardEndpoint != "" && e.kind == kindCode:
			redirects++
			shard := e.Shard
			if shard == "" {
				shard = "?"
			}
			chain = append(chain, fmt.Sprintf("shard %s at %s", shard, e.ShardEndpoint))
			if redirects > maxRedirects {
				return newError(codes.FailedPrecondition, kindTooManyRedirects,
					"worker for %v was redirected more than %d times in a row: %s: check the [[shards]] endpoints",
					w.opts.Pools, maxRedirects, strings.Join(chain, " -> "))
			}
			w.logger().Info("cronoq: reconnecting to the shard of the worker's pools",
				"shard", e.Shard, "endpoint", e.ShardEndpoint, "pools", w.opts.Pools)
			if _, err := w.conn.follow(e.ShardEndpoint, e.Code); err != nil {
				return err
			}
		case errors.Is(err, ErrUnavailable):
			// The leader a standby names, or else the next configured endpoint (so a redirect
			// target that is down sends the worker back to its configured one).
			w.conn.onUnavailable(err)
			if w.conn.isConfigured(w.conn.endpoint()) {
				redirects, chain = 0, []string{w.conn.endpoint().String()}
			}
			if sleep(ctx, row.failed(err, w.conn.endpoint())) != nil {
				return nil // stopped
			}
		default:
			return err
		}
	}
}

func (w *Worker) registered(resp *cronoqv1.RegisterWorkerResponse) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.workerID = resp.GetWorkerId()
	w.heartbeat = max(time.Duration(resp.GetHeartbeatIntervalMs())*time.Millisecond, 100*time.Millisecond)
	// A result must also fit one request on its own; an answer, what this channel receives.
	w.maxResultBytes = int(min(orDefault(resp.GetMaxResultBytes(), defaultMaxResultBytes), maxRequestBytes))
	w.maxLeaseBytes = min(orDefault(resp.GetMaxLeaseBytes(), defaultMaxLeaseBytes), maxRequestBytes)
	w.leaseBytes = w.maxLeaseBytes
	w.maxCheckpoint = int(min(orDefault(resp.GetMaxCheckpointBytes(), defaultMaxCheckpointBytes), maxRequestBytes))
}

func orDefault(v, def uint64) uint64 {
	if v == 0 {
		return def
	}
	return v
}

// finished: stopping, and nothing left to run or to report. Call with mu held.
func (w *Worker) finished() bool {
	return w.stopping && len(w.running) == 0 && len(w.unacked) == 0
}

func (w *Worker) isFinished() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.finished()
}

// closeIfFinished marks the stream's side closed when the worker is finished: a task that
// arrives from then on cannot be reported, so it is dropped (the server releases it).
func (w *Worker) closeIfFinished() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = w.finished()
	return w.closed
}

// finishRunning is the graceful stop: running tasks finish within the grace, the others
// are cancelled and released; then every outcome is reported and the stream closed, for
// at most stopExtraTime more.
func (w *Worker) finishRunning(workDone chan struct{}, cancelCalls context.CancelFunc) {
	deadline := time.Now().Add(w.opts.ShutdownGrace + stopExtraTime)
	w.mu.Lock()
	running := make(map[uint64]*runningTask, len(w.running))
	for id, rt := range w.running {
		running[id] = rt
	}
	w.mu.Unlock()
	if len(running) > 0 {
		w.logger().Info("cronoq: waiting for running tasks", "running", len(running))
		pending := waitAll(running, w.opts.ShutdownGrace)
		if len(pending) > 0 {
			w.logger().Warn("cronoq: releasing tasks still running after the shutdown grace",
				"tasks", len(pending), "grace", w.opts.ShutdownGrace)
			w.mu.Lock()
			for _, rt := range pending {
				rt.releasing = true
			}
			w.mu.Unlock()
			for _, rt := range pending {
				rt.cancel(ErrWorkerStopping)
			}
			stuck := waitAll(pending, unwindTime)
			w.mu.Lock()
			for id, rt := range stuck { // the handler ignores its context: release the task anyway
				w.logFor(w.workerID).Warn("cronoq: handler ignores cancellation; releasing the task", taskFields(id, rt.attempt, rt.pool)...)
				rt.lost = true // whatever it returns later is not reported
				delete(w.running, id)
				w.reportLocked(&cronoqv1.TaskOutcome{TaskId: id, Attempt: rt.attempt,
					Outcome: &cronoqv1.TaskOutcome_Released{Released: &cronoqv1.TaskReleased{Reason: releaseReason}},
					Report:  rt.takeReport(id)}, rt.pool)
			}
			w.mu.Unlock()
		}
	}
	w.notify() // the stream closes its side once every outcome is answered
	select {
	case <-workDone:
	case <-time.After(time.Until(deadline)):
	}
	cancelCalls()
	<-workDone
	w.mu.Lock()
	left := len(w.unacked)
	w.mu.Unlock()
	if left > 0 {
		w.logger().Warn("cronoq: outcomes not acknowledged at shutdown; their leases will expire", "outcomes", left)
	}
}

// waitAll waits up to d for the tasks' handlers to return; it returns those still running.
func waitAll(tasks map[uint64]*runningTask, d time.Duration) map[uint64]*runningTask {
	timer := time.NewTimer(d)
	defer timer.Stop()
	pending := map[uint64]*runningTask{}
	for id, rt := range tasks {
		select {
		case <-rt.done:
		case <-timer.C:
			pending[id] = rt
		}
	}
	// The timer fired: the rest, done or not, are checked without waiting.
	for id, rt := range pending {
		select {
		case <-rt.done:
			delete(pending, id)
		default:
		}
	}
	return pending
}

func (w *Worker) deregister(ctx context.Context) {
	id := w.ID()
	if id == "" {
		return
	}
	err := w.conn.once(ctx, deregisterTimeout, func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
		_, err := cronoqv1.NewWorkerServiceClient(cc).DeregisterWorker(ctx, &cronoqv1.DeregisterWorkerRequest{WorkerId: id}, opts...)
		return err
	})
	if err != nil {
		w.logFor(id).Debug("cronoq: deregister failed", "error", err)
	}
}

// transientStream: failures of a Work stream that say nothing about the request.
func transientStream(err error) bool {
	for _, s := range []error{ErrUnavailable, ErrCancelled, ErrDeadlineExceeded, ErrInternal, ErrUnknown} {
		if errors.Is(err, s) {
			return true
		}
	}
	var e *Error
	return !asError(err, &e) // not a gRPC status: a broken connection
}

// workLoop opens Work streams one after the other until the worker is finished: a stream
// that fails is opened again (on the server an UNAVAILABLE names) after a backoff that grows
// with the failures in a row and starts over after a healthy stream (one that delivered a
// message or stayed open healthyStream); the outcomes it did not answer are sent again on the
// next (fenced by attempt: safe).
func (w *Worker) workLoop(calls context.Context) error {
	row := failureRow{retry: w.conn.retry, log: w.logger, what: "work stream"}
	for !w.isFinished() {
		opened := time.Now()
		answered, err := w.workStream(calls)
		if calls.Err() != nil {
			return nil // the graceful stop's time is up
		}
		if answered || time.Since(opened) >= healthyStream {
			row.succeeded()
		}
		if w.isFinished() {
			return nil
		}
		var e *Error
		switch {
		case err == nil: // the server ended it cleanly: opened again, but not in a tight loop
			err = newError(codes.Unavailable, kindCode, "the server ended the stream")
		case errors.Is(err, ErrPermissionDenied), errors.Is(err, ErrUnauthenticated), errors.Is(err, ErrTLS):
			return err // no retry can help: Run fails with the reason
		case errors.Is(err, ErrFailedPrecondition) && asError(err, &e) && e.ShardEndpoint != "":
			return err // the pools moved to another shard
		case errors.Is(err, ErrUnavailable):
			w.conn.onUnavailable(err) // to the leader a standby names, or the next endpoint
		case errors.Is(err, ErrNotFound), transientStream(err): // e.g. a server that stops or steps down
		default: // e.g. RESOURCE_EXHAUSTED, an answer over the receive limit: smaller answers
			w.mu.Lock()
			w.leaseBytes = max(w.leaseBytes/2, minLeaseBytes)
			w.mu.Unlock()
			w.logger().Error("cronoq: work stream failed; opening it again with a smaller max_bytes", "error", err)
		}
		_ = sleep(calls, row.failed(err, w.conn.endpoint()))
		if errors.Is(err, ErrNotFound) {
			w.logger().Warn("cronoq: worker unknown to the server; registering again")
			if err := w.register(calls); err != nil {
				return err
			}
		}
	}
	return nil
}

// workStream is one Work stream: the first message gives the free slots (held tasks, still
// leased to this worker, count as taken); the sender sends outcomes, freed slots and
// heartbeats; answers are read here until the server ends it.
// answered: the server sent a message on it.
func (w *Worker) workStream(calls context.Context) (answered bool, err error) {
	cc, ep, err := w.conn.channel()
	if err != nil {
		return false, err
	}
	ctx, cancel := context.WithCancel(w.conn.outgoing(calls))
	defer cancel()
	stream, err := cronoqv1.NewWorkerServiceClient(cc).Work(ctx)
	if err != nil {
		return false, w.conn.diagnose(ep, fromGRPC(err, nil))
	}
	w.mu.Lock()
	w.outcomes = w.outcomes[:0]
	for _, o := range w.unacked { // what an earlier stream did not answer
		w.outcomes = append(w.outcomes, o.outcome)
	}
	w.freed = 0
	w.closed = false
	w.beatsSent, w.beatsAnswered = 0, 0
	for _, rt := range w.running { // what an earlier stream's heartbeats carried unanswered
		rt.progress.unsent()
		rt.saved.unsent()
	}
	free := 0
	if !w.stopping {
		free = w.opts.Concurrency + w.opts.Prefetch - len(w.running) - len(w.held)
	}
	first := &cronoqv1.WorkRequest{
		WorkerId: w.workerID, Credits: uint32(max(free, 0)), MaxBytes: w.leaseBytes, Slots: uint32(w.opts.Concurrency),
	}
	resend := len(w.outcomes) > 0
	w.mu.Unlock()
	if resend {
		w.notify() // sent right after the first message
	}
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		w.sendLoop(ctx, stream, first)
	}()
	defer func() {
		cancel()
		<-sent
	}()
	for {
		answer, err := stream.Recv()
		if err == io.EOF {
			return answered, nil
		}
		if err != nil {
			return answered, w.conn.diagnose(ep, fromGRPC(err, stream.Trailer()))
		}
		answered = true
		w.answered(answer)
	}
}

// sendLoop sends the stream's messages: outcomes (lingering a moment while handlers run,
// so more join), the slots handlers freed, heartbeats; it closes its side once stopping
// and every outcome is answered.
func (w *Worker) sendLoop(ctx context.Context, stream grpc.BidiStreamingClient[cronoqv1.WorkRequest, cronoqv1.WorkResponse], first *cronoqv1.WorkRequest) {
	message := first
	for {
		if message != nil {
			if err := stream.Send(message); err != nil {
				return // the stream ended: the reader sees why
			}
		}
		if w.closeIfFinished() {
			// Closing: every outcome is answered; a task sent from now on is dropped, and the
			// server, told so, releases it as the stream ends.
			_ = stream.Send(&cronoqv1.WorkRequest{Closing: true})
			_ = stream.CloseSend()
			return
		}
		select {
		case <-w.wake:
		case <-ctx.Done():
			return
		}
		w.mu.Lock()
		linger := w.opts.FinishLinger > 0 && len(w.outcomes) > 0 && len(w.running) > 0 &&
			len(w.outcomes) < maxFinishBatch && !w.stopping
		w.mu.Unlock()
		if linger && !w.linger(ctx) {
			return
		}
		message = w.nextMessage()
	}
}

// linger waits for more outcomes to join the ones pending: until every running handler
// has returned, the batch is full, or FinishLinger passes. False when ctx ends first.
func (w *Worker) linger(ctx context.Context) bool {
	timer := time.NewTimer(w.opts.FinishLinger)
	defer timer.Stop()
	for {
		select {
		case <-w.wake: // each handler that returns wakes the sender
			w.mu.Lock()
			more := len(w.running) > 0 && len(w.outcomes) < maxFinishBatch
			w.mu.Unlock()
			if !more {
				return true
			}
		case <-timer.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
}

// nextMessage is the next message to send, or nil when there is nothing to say: a heartbeat
// carries the reports of running handlers that the server has not acknowledged.
func (w *Worker) nextMessage() *cronoqv1.WorkRequest {
	w.mu.Lock()
	defer w.mu.Unlock()
	m := &cronoqv1.WorkRequest{Outcomes: w.nextBatch()}
	if !w.stopping {
		m.Credits, w.freed = w.freed, 0
	}
	if w.beatDue {
		w.beatDue = false
		beat := &cronoqv1.WorkHeartbeat{}
		for id, rt := range w.running {
			beat.Tasks = append(beat.Tasks, &cronoqv1.TaskAttempt{TaskId: id, Attempt: rt.attempt})
		}
		heldIDs := make(map[uint64]bool, len(w.held))
		for _, h := range w.held { // their leases must not expire while they wait
			heldIDs[h.task.GetId()] = true
			beat.Tasks = append(beat.Tasks, &cronoqv1.TaskAttempt{TaskId: h.task.GetId(), Attempt: h.task.GetAttempt()})
		}
		for id, o := range w.unacked {
			if _, ok := w.running[id]; !ok && !heldIDs[id] {
				beat.Tasks = append(beat.Tasks, &cronoqv1.TaskAttempt{TaskId: id, Attempt: o.outcome.GetAttempt()})
			}
		}
		m.Heartbeat = beat
		w.beatReports(m, proto.Size(m))
	}
	if len(w.outcomes) > 0 {
		w.notify() // the rest in the next message
	}
	if len(m.Outcomes) == 0 && m.Credits == 0 && m.Heartbeat == nil {
		return nil
	}
	return m
}

// nextBatch takes the oldest outcomes that fit one message: at most maxFinishBatch and
// maxRequestBytes serialized (one always goes, alone if need be). Call with mu held.
func (w *Worker) nextBatch() []*cronoqv1.TaskOutcome {
	size, n := framing, 0
	for _, o := range w.outcomes {
		if n == maxFinishBatch {
			break
		}
		size += proto.Size(o) + framing
		if n > 0 && size > maxRequestBytes {
			break
		}
		n++
	}
	batch := append([]*cronoqv1.TaskOutcome(nil), w.outcomes[:n]...)
	w.outcomes = w.outcomes[n:]
	return batch
}

// answered handles what the server sent: tasks to run (or hold, when every slot is taken),
// the results of outcomes, a heartbeat's answer.
func (w *Worker) answered(answer *cronoqv1.WorkResponse) {
	w.mu.Lock()
	defer w.notify()
	defer w.mu.Unlock()
	for _, r := range answer.GetResults() {
		sent, ok := w.unacked[r.GetTaskId()]
		if ok {
			delete(w.unacked, r.GetTaskId())
			w.processed++
		}
		if !r.GetAccepted() {
			w.logFor(w.workerID).Warn("cronoq: outcome refused",
				taskFields(r.GetTaskId(), sent.outcome.GetAttempt(), sent.pool, "code", r.GetCode(), "message", r.GetMessage())...)
		}
	}
	for _, task := range answer.GetTasks() {
		if w.closed { // sent as the stream closed: the server releases it, as nothing can be sent
			w.logFor(w.workerID).Debug("cronoq: task arrived after the work stream closed; the server releases it",
				taskFields(task.GetId(), task.GetAttempt(), task.GetPool())...)
			continue
		}
		if w.stopping { // sent for slots given before the stop: give it back
			w.freed++
			w.reportLocked(releasedOutcome(task), task.GetPool())
			continue
		}
		// A free slot means none is held (a slot that frees takes the oldest held task): the
		// task starts at once; otherwise it is held, behind those already held.
		received := time.Now()
		if len(w.running) < w.opts.Concurrency {
			w.start(task, received)
		} else {
			w.held = append(w.held, heldTask{task: task, received: received})
		}
	}
	if beat := answer.GetHeartbeat(); beat != nil {
		w.beatsAnswered++
		for _, rt := range w.running {
			rt.progress.acknowledged(w.beatsAnswered)
			rt.saved.acknowledged(w.beatsAnswered)
		}
		for _, id := range beat.GetCancelledTaskIds() {
			if rt, ok := w.running[id]; ok {
				rt.cancelRequested = true
				rt.cancel(ErrTaskCancelled)
			}
		}
		for _, id := range beat.GetLostTaskIds() {
			if rt, ok := w.running[id]; ok {
				w.logFor(w.workerID).Warn("cronoq: task lost its lease; its outcome will not be reported",
					taskFields(id, rt.attempt, rt.pool)...)
				rt.lost = true
				rt.cancel(ErrLeaseLost)
			}
		}
		w.dropHeld(beat)
	}
}

// dropHeld takes the held tasks a heartbeat's answer names out of the hold, each giving its
// credit back: a cancelled one is reported CANCELLED (its handler never runs), a lost one is
// dropped unreported. Call with mu held.
func (w *Worker) dropHeld(beat *cronoqv1.HeartbeatResponse) {
	if len(w.held) == 0 {
		return
	}
	cancelled := make(map[uint64]bool, len(beat.GetCancelledTaskIds()))
	for _, id := range beat.GetCancelledTaskIds() {
		cancelled[id] = true
	}
	lost := make(map[uint64]bool, len(beat.GetLostTaskIds()))
	for _, id := range beat.GetLostTaskIds() {
		lost[id] = true
	}
	kept := w.held[:0]
	for _, h := range w.held {
		id := h.task.GetId()
		switch {
		case lost[id]:
			w.logFor(w.workerID).Warn("cronoq: held task lost its lease before it started; it is dropped",
				taskFields(id, h.task.GetAttempt(), h.task.GetPool())...)
			w.freed++
		case cancelled[id]:
			w.freed++
			w.reportLocked(&cronoqv1.TaskOutcome{TaskId: id, Attempt: h.task.GetAttempt(),
				Outcome: &cronoqv1.TaskOutcome_Cancelled{Cancelled: &cronoqv1.TaskCancelled{Reason: "cancelled"}}}, h.task.GetPool())
		default:
			kept = append(kept, h)
		}
	}
	clear(w.held[len(kept):]) // no reference kept to the tasks dropped
	w.held = kept
}

// releaseHeld gives every held task back to the server at the stop, before running
// handlers are waited for. Call with mu held, then notify.
func (w *Worker) releaseHeld() {
	if len(w.held) > 0 {
		w.logFor(w.workerID).Info("cronoq: releasing held tasks", "tasks", len(w.held))
	}
	for _, h := range w.held {
		w.freed++
		w.reportLocked(releasedOutcome(h.task), h.task.GetPool())
	}
	w.held = nil
}

// releasedOutcome gives a task back unfinished: the server makes it PENDING at once, the
// attempt not counted.
func releasedOutcome(task *Task) *cronoqv1.TaskOutcome {
	return &cronoqv1.TaskOutcome{TaskId: task.GetId(), Attempt: task.GetAttempt(),
		Outcome: &cronoqv1.TaskOutcome_Released{Released: &cronoqv1.TaskReleased{Reason: releaseReason}}}
}

// start runs a task's handler in its own goroutine; received is when the worker got the
// task. Call with mu held.
func (w *Worker) start(task *Task, received time.Time) {
	ctx, cancel := context.WithCancelCause(w.tasks)
	rt := &runningTask{attempt: task.GetAttempt(), pool: task.GetPool(), cancel: cancel, done: make(chan struct{})}
	if c := task.GetCheckpoint(); len(c) > 0 {
		rt.checkpoint = c
	}
	w.running[task.GetId()] = rt
	go func() {
		defer close(rt.done)
		defer cancel(nil)
		w.execute(ctx, rt, task, received)
	}()
}

// execute runs a task's handler, in the task's span (startTaskSpan) with its TaskContext,
// and reports its outcome.
func (w *Worker) execute(ctx context.Context, rt *runningTask, task *Task, received time.Time) {
	hctx, span := startTaskSpan(ctx, task)
	hctx = context.WithValue(hctx, taskContextKey{}, &TaskContext{w: w, id: task.GetId(), rt: rt, snoozes: task.GetSnoozes(),
		dependencies: DependencyResultsOf(task), span: span.SpanContext()})
	if ms := task.GetTimeoutMs(); ms > 0 {
		// The timeout counts from the lease (a held task's wait counts too), and the server
		// never extends the lease past the attempt's deadline: cancel it there.
		var stop context.CancelFunc
		hctx, stop = context.WithDeadlineCause(hctx, received.Add(time.Duration(ms)*time.Millisecond), ErrTaskTimeout)
		defer stop()
	}
	result, err := w.callHandler(hctx, task)
	timedOut := errors.Is(context.Cause(hctx), ErrTaskTimeout)

	outcome := &cronoqv1.TaskOutcome{TaskId: task.GetId(), Attempt: task.GetAttempt()}
	w.mu.Lock()
	lost, cancelRequested, releasing, maxResult := rt.lost, rt.cancelRequested, rt.releasing, w.maxResultBytes
	if lost {
		w.endRunning(task, rt)
	}
	w.mu.Unlock()
	if lost { // no longer ours (or released already at shutdown)
		w.endLost(span, task, releasing)
		return
	}
	failure := func(msg string, retryable bool, after time.Duration) {
		f := &cronoqv1.TaskFailure{Error: msg, Retryable: retryable}
		if after > 0 {
			f.RetryAfterMs = uint32(min(max(after.Milliseconds(), 1), 1<<31))
		}
		outcome.Outcome = &cronoqv1.TaskOutcome_Failure{Failure: f}
	}
	var taskErr *TaskError
	var snooze *SnoozeError
	switch {
	case err == nil:
		data, contentType, encErr := EncodePayload(result)
		switch {
		case encErr != nil:
			failure(fmt.Sprintf("result: %v", encErr), false, 0)
		case len(data) > maxResult:
			failure(fmt.Sprintf("result of %d bytes exceeds max_result_bytes %d", len(data), maxResult), false, 0)
		default:
			outcome.Outcome = &cronoqv1.TaskOutcome_Success{Success: &cronoqv1.TaskSuccess{Result: data, ContentType: contentType}}
		}
	case cancelRequested: // the server asked: the task ends CANCELLED
		outcome.Outcome = &cronoqv1.TaskOutcome_Cancelled{Cancelled: &cronoqv1.TaskCancelled{Reason: "cancelled"}}
	case releasing: // shutdown: give it back unfinished
		outcome.Outcome = &cronoqv1.TaskOutcome_Released{Released: &cronoqv1.TaskReleased{Reason: releaseReason}}
	case timedOut:
		failure(fmt.Sprintf("timed out after %d ms", task.GetTimeoutMs()), true, 0)
	case errors.As(err, &snooze):
		if ms, bad := snoozeMs(snooze.Duration, snooze.Reason); bad != nil { // a SnoozeError not from Snooze
			failure(bad.Error(), true, 0)
		} else {
			outcome.Outcome = &cronoqv1.TaskOutcome_Snoozed{Snoozed: &cronoqv1.TaskSnoozed{SnoozeMs: ms, Reason: snooze.Reason}}
		}
	case errors.As(err, &taskErr):
		failure(taskErr.Error(), taskErr.Retryable, taskErr.RetryAfter)
	default:
		failure(err.Error(), true, 0)
	}
	validUTF8(outcome)
	// The task leaves running and its outcome joins unacked at once: a stop in between would
	// find nothing to run or report and close the stream before the outcome is sent.
	w.mu.Lock()
	lost, releasing = rt.lost, rt.releasing // lost (or released at shutdown) while the outcome was made
	// Taken as the task leaves running: a Spawn from then on is refused, none is dropped unsaid.
	withSpawned(outcome, rt.spawned)
	outcome.Report = w.endRunning(task, rt)
	if !lost {
		w.reportLocked(outcome, task.GetPool())
	}
	w.mu.Unlock()
	if lost {
		w.endLost(span, task, releasing)
		return
	}
	endTaskSpan(span, outcome)
	w.notify()
}

// endRunning takes the task out of running when it is still there (its slot is free, the
// oldest held task starts in it) and returns what no answered heartbeat carried of its
// reports. Call with mu held, then notify.
func (w *Worker) endRunning(task *Task, rt *runningTask) *cronoqv1.TaskReport {
	if w.running[task.GetId()] != rt {
		return nil
	}
	delete(w.running, task.GetId())
	w.freed++
	w.startHeld()
	return rt.takeReport(task.GetId())
}

// endLost ends the span of a task no longer ours: released at shutdown, or its lease lost.
func (w *Worker) endLost(span trace.Span, task *Task, releasing bool) {
	var reported *cronoqv1.TaskOutcome // none: the lease was lost
	if releasing {
		reported = releasedOutcome(task)
	}
	endTaskSpan(span, reported)
	w.notify()
}

// startHeld starts the oldest held task in the slot a handler freed (none once stopping:
// they were released). One whose timeout passed while it was held is not started: it fails,
// retryable, as a handler that timed out does, and the next one is tried. Call with mu
// held, then notify.
func (w *Worker) startHeld() {
	for len(w.held) > 0 && !w.stopping && len(w.running) < w.opts.Concurrency {
		next := w.held[0]
		w.held[0] = heldTask{}
		w.held = w.held[1:]
		ms := next.task.GetTimeoutMs()
		if ms > 0 && !time.Now().Before(next.received.Add(time.Duration(ms)*time.Millisecond)) {
			w.freed++
			w.reportLocked(&cronoqv1.TaskOutcome{TaskId: next.task.GetId(), Attempt: next.task.GetAttempt(),
				Outcome: &cronoqv1.TaskOutcome_Failure{Failure: &cronoqv1.TaskFailure{
					Error: fmt.Sprintf("timed out after %d ms, held before it could start", ms), Retryable: true}}},
				next.task.GetPool())
			continue
		}
		w.start(next.task, next.received)
	}
}

// callHandler runs the handler; a panic fails the attempt (retryable) with its stack logged.
func (w *Worker) callHandler(ctx context.Context, task *Task) (result any, err error) {
	defer func() {
		if p := recover(); p != nil {
			w.logFor(w.ID()).Error("cronoq: handler panicked",
				taskFields(task.GetId(), task.GetAttempt(), task.GetPool(), "panic", p, "stack", string(debug.Stack()))...)
			result, err = nil, fmt.Errorf("panic: %v", p)
		}
	}()
	return w.handler(ctx, task)
}

// reportLocked queues an outcome of a task of pool; call with mu held, then notify.
func (w *Worker) reportLocked(outcome *cronoqv1.TaskOutcome, pool string) {
	validUTF8(outcome)
	w.unacked[outcome.GetTaskId()] = sentOutcome{outcome: outcome, pool: pool}
	w.outcomes = append(w.outcomes, outcome)
}

// validUTF8 makes every string of an outcome valid UTF-8, each invalid byte sequence
// replaced by U+FFFD: protobuf refuses to marshal a string that is not, and the message
// that carries it (every outcome of the batch) could not be sent. A handler's error text
// (TaskFailure.error) may be anything.
func validUTF8(o *cronoqv1.TaskOutcome) {
	valid := func(s *string) {
		if !utf8.ValidString(*s) {
			*s = strings.ToValidUTF8(*s, "\uFFFD")
		}
	}
	switch v := o.GetOutcome().(type) {
	case *cronoqv1.TaskOutcome_Success:
		valid(&v.Success.ContentType)
	case *cronoqv1.TaskOutcome_Failure:
		valid(&v.Failure.Error)
	case *cronoqv1.TaskOutcome_Snoozed:
		valid(&v.Snoozed.Reason)
	case *cronoqv1.TaskOutcome_Cancelled:
		valid(&v.Cancelled.Reason)
	case *cronoqv1.TaskOutcome_Released:
		valid(&v.Released.Reason)
	}
	if p := o.GetReport().GetProgress(); p != nil {
		valid(&p.Message)
	}
}

// logger is the worker's logger with its id, as logFor; call without mu held.
func (w *Worker) logger() *slog.Logger { return w.logFor(w.ID()) }

// logFor is the worker's logger with the worker's id (workerID, once registered) as
// worker_id, as the server's JSON logs name it.
func (w *Worker) logFor(workerID string) *slog.Logger {
	if workerID == "" {
		return w.log
	}
	return w.log.With("worker_id", workerID)
}

// taskFields are the fields of a log line about one attempt of a task, named as the
// server's JSON logs name them (task_id as a decimal string), then more.
func taskFields(id uint64, attempt int32, pool string, more ...any) []any {
	return append([]any{"task_id", strconv.FormatUint(id, 10), "attempt", attempt, "pool", pool}, more...)
}

// heartbeatLoop asks the sender for a heartbeat of the attempts held, every interval.
func (w *Worker) heartbeatLoop(ctx context.Context) {
	w.mu.Lock()
	interval := w.heartbeat
	w.mu.Unlock()
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
			w.mu.Lock()
			w.beatDue = true
			w.mu.Unlock()
			w.notify()
		}
	}
}
