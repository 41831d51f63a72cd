package cronoq

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// workServer hands out its tasks as credits allow and records every outcome.
type workServer struct {
	cronoqv1.UnimplementedWorkerServiceServer
	mu           sync.Mutex
	tasks        []*cronoqv1.Task
	outcomes     map[uint64]*cronoqv1.TaskOutcome
	beats        map[uint64]int
	cancel       map[uint64]bool
	lost         map[uint64]bool // named lost by every heartbeat answer
	refuse       map[uint64]bool // outcomes answered not accepted
	deregistered bool
	unused       int      // credits given and not used, on the current stream
	firstCredits []uint32 // the credits of each stream's first message
	firstSlots   []uint32 // the slots of each stream's first message
	laterSlots   int      // messages after a stream's first that set slots
	leased       int      // tasks sent and not yet reported
	mostLeased   int
	breakFirst   bool // end the first stream UNAVAILABLE once it has sent tasks
	// The heartbeat interval (50 ms when 0; the worker's floor is 100 ms); heartbeats left
	// unanswered; the first stream ended UNAVAILABLE once a heartbeat carried a report; the
	// streams opened, and the reports heartbeats carried.
	beatMs        uint32
	silentBeats   bool
	breakOnReport bool
	streams       int
	beatReports   []streamReport
}

// streamReport is a report a heartbeat carried, on the stream-th Work stream.
type streamReport struct {
	stream int
	report *cronoqv1.TaskReport
}

func newWorkServer(tasks ...*cronoqv1.Task) *workServer {
	return &workServer{tasks: tasks, outcomes: map[uint64]*cronoqv1.TaskOutcome{}, beats: map[uint64]int{}, cancel: map[uint64]bool{},
		lost: map[uint64]bool{}, refuse: map[uint64]bool{}}
}

func (s *workServer) RegisterWorker(context.Context, *cronoqv1.RegisterWorkerRequest) (*cronoqv1.RegisterWorkerResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &cronoqv1.RegisterWorkerResponse{WorkerId: "w-1", HeartbeatIntervalMs: cmp.Or(s.beatMs, 50), Shard: "default"}, nil
}

func (s *workServer) DeregisterWorker(context.Context, *cronoqv1.DeregisterWorkerRequest) (*cronoqv1.DeregisterWorkerResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.deregistered = true
	return &cronoqv1.DeregisterWorkerResponse{}, nil
}

func (s *workServer) Work(stream grpc.BidiStreamingServer[cronoqv1.WorkRequest, cronoqv1.WorkResponse]) error {
	s.mu.Lock()
	s.unused = 0
	s.streams++
	s.mu.Unlock()
	for first := true; ; first = false {
		req, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		s.mu.Lock()
		if first {
			s.firstCredits = append(s.firstCredits, req.GetCredits())
			s.firstSlots = append(s.firstSlots, req.GetSlots())
		} else if req.GetSlots() != 0 {
			s.laterSlots++
		}
		s.mu.Unlock()
		resp := s.step(req)
		if err := stream.Send(resp); err != nil {
			return err
		}
		s.mu.Lock()
		broken := s.breakFirst && len(resp.Tasks) > 0
		s.breakFirst = s.breakFirst && !broken
		if s.breakOnReport && len(req.GetHeartbeat().GetReports()) > 0 {
			broken, s.breakOnReport = true, false
		}
		s.mu.Unlock()
		if broken {
			return status.Error(codes.Unavailable, "the server went away")
		}
	}
}

func (s *workServer) step(req *cronoqv1.WorkRequest) *cronoqv1.WorkResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &cronoqv1.WorkResponse{}
	for _, o := range req.GetOutcomes() {
		if _, ok := s.outcomes[o.GetTaskId()]; !ok {
			s.leased--
		}
		s.outcomes[o.GetTaskId()] = o
		result := &cronoqv1.FinishTaskResult{TaskId: o.GetTaskId(), Accepted: true}
		if s.refuse[o.GetTaskId()] {
			result = &cronoqv1.FinishTaskResult{TaskId: o.GetTaskId(), Code: "FAILED_PRECONDITION", Message: "the attempt is not current"}
		}
		resp.Results = append(resp.Results, result)
	}
	if beat := req.GetHeartbeat(); beat != nil && !s.silentBeats {
		resp.Heartbeat = &cronoqv1.HeartbeatResponse{}
		for _, a := range beat.GetTasks() {
			s.beats[a.GetTaskId()]++
			if s.cancel[a.GetTaskId()] {
				resp.Heartbeat.CancelledTaskIds = append(resp.Heartbeat.CancelledTaskIds, a.GetTaskId())
			}
			if s.lost[a.GetTaskId()] {
				resp.Heartbeat.LostTaskIds = append(resp.Heartbeat.LostTaskIds, a.GetTaskId())
			}
		}
	}
	for _, r := range req.GetHeartbeat().GetReports() {
		s.beatReports = append(s.beatReports, streamReport{stream: s.streams, report: r})
	}
	s.unused += int(req.GetCredits())
	for s.unused > 0 && len(s.tasks) > 0 {
		resp.Tasks = append(resp.Tasks, s.tasks[0])
		s.tasks = s.tasks[1:]
		s.unused--
		s.leased++
	}
	s.mostLeased = max(s.mostLeased, s.leased)
	return resp
}

func (s *workServer) outcome(id uint64) *cronoqv1.TaskOutcome {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.outcomes[id]
}

func jsonTask(id uint64, payload string) *cronoqv1.Task {
	return &cronoqv1.Task{Id: id, Attempt: 1, Pool: "default", Payload: []byte(payload), ContentType: JSONContentType}
}

func startWorker(t *testing.T, srv *workServer, opts WorkerOptions, handler Handler) (*Worker, chan error) {
	t.Helper()
	return startWorkerIn(t, context.Background(), srv, opts, handler)
}

// startWorkerIn starts a worker as startWorker does, its Run given ctx.
func startWorkerIn(t *testing.T, ctx context.Context, srv *workServer, opts WorkerOptions, handler Handler) (*Worker, chan error) {
	t.Helper()
	addr := serve(t, func(s *grpc.Server) { cronoqv1.RegisterWorkerServiceServer(s, srv) })
	opts.Endpoint, opts.Pools, opts.Logger = "http://"+addr, []string{"default"}, quietLogger()
	opts.Retry = fastRetry()
	w, err := NewWorker(opts, handler)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	return w, done
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestWorkerRunsTasksWithinItsConcurrency(t *testing.T) {
	srv := newWorkServer()
	for id := uint64(1); id <= 12; id++ {
		srv.tasks = append(srv.tasks, jsonTask(id|1<<63, `{"n": 1}`))
	}
	srv.tasks = append(srv.tasks, jsonTask(100, `{"bad": true}`))
	var running, most atomic.Int32
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 3}, func(ctx context.Context, task *Task) (any, error) {
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		var in map[string]any
		if err := DecodePayload(task, &in); err != nil {
			return nil, err
		}
		if in["bad"] == true {
			return nil, NonRetryable(errors.New("bad input"))
		}
		time.Sleep(10 * time.Millisecond)
		return map[string]uint64{"id": task.GetId()}, nil
	})
	waitFor(t, "13 outcomes", func() bool { return w.Processed() == 13 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if most.Load() > 3 {
		t.Errorf("%d handlers ran at once, concurrency 3", most.Load())
	}
	top := srv.outcome(1 | 1<<63)
	if top.GetSuccess() == nil || string(top.GetSuccess().GetResult()) != `{"id":9223372036854775809}` {
		t.Errorf("top-bit task: %v", top)
	}
	if f := srv.outcome(100).GetFailure(); f == nil || f.GetRetryable() || f.GetError() != "bad input" {
		t.Errorf("non-retryable failure: %v", srv.outcome(100))
	}
	if !srv.deregistered {
		t.Error("not deregistered on stop")
	}
}

func TestWorkerCancelThroughHeartbeat(t *testing.T) {
	srv := newWorkServer(jsonTask(7, `{}`))
	srv.cancel[7] = true
	var cause atomic.Value
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		<-ctx.Done()
		cause.Store(context.Cause(ctx))
		return nil, ctx.Err()
	})
	waitFor(t, "the cancelled outcome", func() bool { return srv.outcome(7) != nil })
	w.Stop()
	<-done
	if srv.outcome(7).GetCancelled() == nil || cause.Load() != ErrTaskCancelled {
		t.Errorf("outcome %v, cause %v", srv.outcome(7), cause.Load())
	}
}

func TestWorkerGracefulStopReleasesWhatItCannotFinish(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{"sleep_ms": 60000}`), jsonTask(2, `{"sleep_ms": 50}`))
	var started atomic.Int32
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 2, ShutdownGrace: 300 * time.Millisecond},
		func(ctx context.Context, task *Task) (any, error) {
			started.Add(1)
			var in struct {
				SleepMs int64 `json:"sleep_ms"`
			}
			_ = DecodePayload(task, &in)
			select {
			case <-time.After(time.Duration(in.SleepMs) * time.Millisecond):
				return "done", nil
			case <-ctx.Done():
				if context.Cause(ctx) != ErrWorkerStopping {
					t.Errorf("cause %v", context.Cause(ctx))
				}
				return nil, ctx.Err()
			}
		})
	waitFor(t, "both tasks started", func() bool { return started.Load() == 2 })
	stopped := time.Now()
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if took := time.Since(stopped); took < 300*time.Millisecond || took > 3*time.Second {
		t.Errorf("stop took %v with a 300ms grace", took)
	}
	if srv.outcome(1).GetReleased() == nil || srv.outcome(2).GetSuccess() == nil {
		t.Errorf("outcomes: 1 %v, 2 %v; want released, success", srv.outcome(1), srv.outcome(2))
	}
}

func TestWorkerHeartbeatsNameRunningTasks(t *testing.T) {
	srv := newWorkServer(jsonTask(5, `{}`))
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		time.Sleep(300 * time.Millisecond)
		return nil, nil
	})
	waitFor(t, "the outcome", func() bool { return srv.outcome(5) != nil })
	w.Stop()
	<-done
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if srv.beats[5] < 2 {
		t.Errorf("task 5 named in %d heartbeats over 300ms at 50ms intervals", srv.beats[5])
	}
}

func TestWorkerOptionsAreChecked(t *testing.T) {
	handler := func(context.Context, *Task) (any, error) { return nil, nil }
	if _, err := NewWorker(WorkerOptions{}, handler); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no pools: %v", err)
	}
	if _, err := NewWorker(WorkerOptions{Pools: []string{"p"}, Concurrency: -1}, handler); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("negative concurrency: %v", err)
	}
	if _, err := NewWorker(WorkerOptions{Pools: []string{"p"}, Prefetch: -2}, handler); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "prefetch: -2") {
		t.Errorf("prefetch -2: %v", err)
	}
	if _, err := NewWorker(WorkerOptions{Pools: []string{"p"}, Prefetch: 99_985}, handler); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "prefetch: 99985") {
		t.Errorf("concurrency 16 + prefetch 99,985: %v", err)
	}
	if _, err := NewWorker(WorkerOptions{Pools: []string{"p"}, Prefetch: 99_984}, handler); err != nil {
		t.Errorf("concurrency 16 + prefetch 99,984: %v", err)
	}
	if _, err := NewWorker(WorkerOptions{Pools: []string{"p"}, Concurrency: 100_001, Prefetch: NoPrefetch}, handler); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "concurrency (100001)") {
		t.Errorf("concurrency 100,001 without prefetch: %v", err)
	}
	if _, err := NewWorker(WorkerOptions{Pools: []string{"p"}}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no handler: %v", err)
	}
	w, err := NewWorker(WorkerOptions{Pools: []string{"p"}}, handler)
	if err != nil || w.opts.Concurrency != 16 || w.opts.Prefetch != 64 || w.opts.ShutdownGrace != 30*time.Second ||
		w.Endpoint().String() != DefaultEndpoint {
		t.Errorf("defaults: %+v, %v", w.opts, err)
	}
}

func TestWorkerPrefetchDefaultsToFourTasksASlot(t *testing.T) {
	handler := func(context.Context, *Task) (any, error) { return nil, nil }
	for _, c := range []struct{ concurrency, prefetch, want int }{
		{1, 0, 4},
		{16, 0, 64},
		{20_000, 0, 80_000},
		{99_000, 0, 1_000}, // 4 a slot would pass the most a worker holds
		{100_000, 0, 0},
		{16, NoPrefetch, 0},
		{16, 7, 7},
	} {
		w, err := NewWorker(WorkerOptions{Pools: []string{"p"}, Concurrency: c.concurrency, Prefetch: c.prefetch}, handler)
		if err != nil || w.opts.Prefetch != c.want {
			t.Errorf("concurrency %d, prefetch %d: held beyond the slots %d (%v), want %d", c.concurrency, c.prefetch, w.opts.Prefetch, err, c.want)
		}
	}
}

func TestWorkerGivesItsSlotsInEachStreamsFirstMessage(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{}`), jsonTask(2, `{}`))
	srv.breakFirst = true
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 3}, (&sleepHandler{}).handle)
	waitFor(t, "2 outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	<-done
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if len(srv.firstSlots) < 2 || srv.firstSlots[0] != 3 || srv.firstSlots[1] != 3 {
		t.Errorf("slots of each stream's first message %v, want 3 on each of at least 2 streams", srv.firstSlots)
	}
	if srv.firstCredits[0] != 3+12 {
		t.Errorf("first credits %v, want 15 (concurrency 3 + the default prefetch 12)", srv.firstCredits)
	}
	if srv.laterSlots != 0 {
		t.Errorf("%d messages after a stream's first set slots", srv.laterSlots)
	}
}

// redirectServer refuses RegisterWorker, naming another shard's endpoint.
type redirectServer struct {
	cronoqv1.UnimplementedWorkerServiceServer
	to    string
	calls atomic.Int32
}

func (s *redirectServer) RegisterWorker(ctx context.Context, _ *cronoqv1.RegisterWorkerRequest) (*cronoqv1.RegisterWorkerResponse, error) {
	s.calls.Add(1)
	_ = grpc.SetTrailer(ctx, metadata.Pairs("cronoq-shard", "gpu", "cronoq-shard-endpoint", s.to))
	return nil, status.Error(codes.FailedPrecondition, "pool default is served by shard gpu at "+s.to)
}

func TestWorkerFollowsThreeRedirectsAndRefusesTheFourth(t *testing.T) {
	// e <- d <- c <- b <- a: a worker configured with a is sent to b, c, d, and refused at d.
	e := &redirectServer{to: "http://127.0.0.1:1"}
	url := "http://" + serve(t, func(s *grpc.Server) { cronoqv1.RegisterWorkerServiceServer(s, e) })
	chain := []*redirectServer{}
	for range 4 {
		r := &redirectServer{to: url}
		chain = append([]*redirectServer{r}, chain...)
		url = "http://" + serve(t, func(s *grpc.Server) { cronoqv1.RegisterWorkerServiceServer(s, r) })
	}
	w, err := NewWorker(WorkerOptions{Options: Options{Endpoint: url, Retry: fastRetry(), Logger: quietLogger()}, Pools: []string{"default"}},
		func(context.Context, *Task) (any, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	err = w.Run(context.Background())
	if !errors.Is(err, ErrTooManyRedirects) || !strings.Contains(err.Error(), "more than 3 times in a row") {
		t.Fatalf("%v, want ErrTooManyRedirects", err)
	}
	for i, r := range chain {
		if r.calls.Load() != 1 {
			t.Errorf("server %d called %d times", i, r.calls.Load())
		}
	}
	if e.calls.Load() != 0 {
		t.Error("the 5th server was called")
	}
}

func TestWorkerGoesBackToItsEndpointWhenTheRedirectTargetIsDown(t *testing.T) {
	srv := newWorkServer(jsonTask(3, `{}`))
	down := "http://127.0.0.1:" + strconv.Itoa(closedPort(t))
	first := &onceRedirect{workServer: srv, to: down}
	addr := serve(t, func(s *grpc.Server) { cronoqv1.RegisterWorkerServiceServer(s, first) })
	w, err := NewWorker(WorkerOptions{Options: Options{Endpoint: "http://" + addr, Retry: fastRetry(), Logger: quietLogger()}, Pools: []string{"default"}},
		func(context.Context, *Task) (any, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(context.Background()) }()
	waitFor(t, "the task's outcome", func() bool { return srv.outcome(3) != nil })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if w.Endpoint().String() != "http://"+addr {
		t.Errorf("endpoint %s, want the configured http://%s", w.Endpoint(), addr)
	}
}

// onceRedirect redirects the first RegisterWorker, then serves.
type onceRedirect struct {
	*workServer
	to         string
	redirected atomic.Bool
}

func (s *onceRedirect) RegisterWorker(ctx context.Context, req *cronoqv1.RegisterWorkerRequest) (*cronoqv1.RegisterWorkerResponse, error) {
	if s.redirected.CompareAndSwap(false, true) {
		_ = grpc.SetTrailer(ctx, metadata.Pairs("cronoq-shard-endpoint", s.to))
		return nil, status.Error(codes.FailedPrecondition, "served by another shard")
	}
	return s.workServer.RegisterWorker(ctx, req)
}

// closedPort is a loopback port where nothing listens.
func closedPort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
}

// refusedWorkServer registers workers and answers every Work stream UNAVAILABLE.
type refusedWorkServer struct {
	cronoqv1.UnimplementedWorkerServiceServer
	streams atomic.Int32
}

func (s *refusedWorkServer) RegisterWorker(context.Context, *cronoqv1.RegisterWorkerRequest) (*cronoqv1.RegisterWorkerResponse, error) {
	return &cronoqv1.RegisterWorkerResponse{WorkerId: "w-1", HeartbeatIntervalMs: 1000}, nil
}

func (s *refusedWorkServer) Work(stream grpc.BidiStreamingServer[cronoqv1.WorkRequest, cronoqv1.WorkResponse]) error {
	s.streams.Add(1)
	_, _ = stream.Recv()
	return status.Error(codes.Unavailable, "going away")
}

// countingHandler counts the log records at each level.
type countingHandler struct {
	mu     sync.Mutex
	levels map[slog.Level]int
}

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.levels[r.Level]++
	return nil
}
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *countingHandler) WithGroup(string) slog.Handler      { return h }

// Timing-sensitive (generous margins): 10 ms doubling to 400 ms with equal jitter waits at
// least 5, 10, 20, 40, 80, 160, 200, 200 ms: at most 10 streams in 1 s.
func TestWorkerReopensARefusedStreamWithBackoffAndOneWarning(t *testing.T) {
	srv := &refusedWorkServer{}
	url := "http://" + serve(t, func(s *grpc.Server) { cronoqv1.RegisterWorkerServiceServer(s, srv) })
	logs := &countingHandler{levels: map[slog.Level]int{}}
	retry := RetryConfig{InitialBackoff: 10 * time.Millisecond, MaxBackoff: 400 * time.Millisecond, MaxElapsed: -1}
	w, err := NewWorker(WorkerOptions{Options: Options{Endpoint: url, Retry: retry, Logger: slog.New(logs)}, Pools: []string{"default"}},
		func(context.Context, *Task) (any, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(context.Background()) }()
	time.Sleep(time.Second)
	opened := srv.streams.Load()
	w.Stop()
	<-done
	if opened < 4 || opened > 10 {
		t.Errorf("%d streams in 1 s, want 4 to 10", opened)
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	if logs.levels[slog.LevelWarn] != 1 || logs.levels[slog.LevelError] != 0 {
		t.Errorf("log records by level: %v, want one warning", logs.levels)
	}
}

// sleepHandler sleeps for the task's "sleep_ms" (or until cancelled), recording the most
// handlers that ran at once and the order they started in.
type sleepHandler struct {
	mu      sync.Mutex
	running int
	most    int
	started []uint64
}

func (h *sleepHandler) handle(ctx context.Context, task *Task) (any, error) {
	var in struct {
		SleepMs int64 `json:"sleep_ms"`
	}
	_ = DecodePayload(task, &in)
	h.mu.Lock()
	h.running++
	h.most = max(h.most, h.running)
	h.started = append(h.started, task.GetId())
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.running--
		h.mu.Unlock()
	}()
	select {
	case <-time.After(time.Duration(in.SleepMs) * time.Millisecond):
		return "done", nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (h *sleepHandler) startedIDs() []uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]uint64(nil), h.started...)
}

func TestWorkerPrefetchHoldsBeyondItsConcurrency(t *testing.T) {
	srv := newWorkServer()
	for id := uint64(1); id <= 12; id++ {
		srv.tasks = append(srv.tasks, jsonTask(id, `{"sleep_ms": 40}`))
	}
	h := &sleepHandler{}
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 2, Prefetch: 3}, h.handle)
	waitFor(t, "12 outcomes", func() bool { return w.Processed() == 12 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if len(srv.firstCredits) != 1 || srv.firstCredits[0] != 5 {
		t.Errorf("first credits %v, want [5] (concurrency 2 + prefetch 3)", srv.firstCredits)
	}
	if srv.mostLeased != 5 {
		t.Errorf("the worker held %d tasks at most, want 5", srv.mostLeased)
	}
	if h.most != 2 {
		t.Errorf("%d handlers ran at once, concurrency 2", h.most)
	}
	for id := uint64(1); id <= 12; id++ {
		if srv.outcomes[id].GetSuccess() == nil {
			t.Errorf("task %d: %v", id, srv.outcomes[id])
		}
	}
	if len(h.started) != 12 {
		t.Errorf("started %v: each task once", h.started)
	}
	if srv.beats[12] == 0 {
		t.Error("task 12, held while others ran, was in no heartbeat")
	}
}

func TestWorkerPrefetchCancelsAndReleasesHeldTasks(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{"sleep_ms": 1000}`), jsonTask(2, `{}`), jsonTask(3, `{}`))
	srv.cancel[2] = true
	h := &sleepHandler{}
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 1, Prefetch: 2}, h.handle)
	waitFor(t, "the held task's cancelled outcome", func() bool { return srv.outcome(2) != nil })
	stopped := time.Now()
	w.Stop()
	waitFor(t, "the held task released", func() bool { return srv.outcome(3) != nil })
	if srv.outcome(1) != nil {
		t.Error("the held task was released only after the running one ended")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if took := time.Since(stopped); took > 2*time.Second {
		t.Errorf("stop took %v", took)
	}
	if srv.outcome(1).GetSuccess() == nil || srv.outcome(2).GetCancelled() == nil || srv.outcome(3).GetReleased() == nil {
		t.Errorf("outcomes: 1 %v, 2 %v, 3 %v; want success, cancelled, released", srv.outcome(1), srv.outcome(2), srv.outcome(3))
	}
	if started := h.startedIDs(); len(started) != 1 || started[0] != 1 {
		t.Errorf("started %v, want only 1", started)
	}
}

func TestWorkerPrefetchedTaskTimesOutFromItsLease(t *testing.T) {
	expires := jsonTask(2, `{}`)
	expires.TimeoutMs = 50
	srv := newWorkServer(jsonTask(1, `{"sleep_ms": 200}`), expires)
	h := &sleepHandler{}
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 1, Prefetch: 1}, h.handle)
	waitFor(t, "2 outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	<-done
	if f := srv.outcome(2).GetFailure(); f == nil || !f.GetRetryable() || !strings.Contains(f.GetError(), "timed out after 50 ms") {
		t.Errorf("the task held past its timeout: %v, want a retryable timeout", srv.outcome(2))
	}
	if started := h.startedIDs(); len(started) != 1 {
		t.Errorf("started %v: the expired task must not start", started)
	}
}

func TestWorkerPrefetchKeepsHeldTasksAcrossABrokenStream(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{"sleep_ms": 300}`), jsonTask(2, `{"sleep_ms": 10}`), jsonTask(3, `{"sleep_ms": 10}`))
	srv.breakFirst = true
	h := &sleepHandler{}
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 1, Prefetch: 2}, h.handle)
	waitFor(t, "3 outcomes", func() bool { return w.Processed() == 3 })
	w.Stop()
	<-done
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if len(srv.firstCredits) < 2 || srv.firstCredits[0] != 3 || srv.firstCredits[1] != 0 {
		t.Errorf("first credits per stream %v, want 3 then 0 (one running, two held)", srv.firstCredits)
	}
	if started := h.startedIDs(); len(started) != 3 || started[0] != 1 || started[1] != 2 || started[2] != 3 {
		t.Errorf("started %v, want each once, in arrival order", started)
	}
	for id := uint64(1); id <= 3; id++ {
		if srv.outcomes[id].GetSuccess() == nil {
			t.Errorf("task %d: %v", id, srv.outcomes[id])
		}
	}
}

// jsonLogs keeps the JSON log lines written to it.
type jsonLogs struct {
	mu    sync.Mutex
	lines []map[string]any
}

func (l *jsonLogs) Write(p []byte) (int, error) {
	var line map[string]any
	if err := json.Unmarshal(p, &line); err != nil {
		return 0, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, line)
	return len(p), nil
}

func (l *jsonLogs) find(msg string) map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if line["msg"] == msg {
			return line
		}
	}
	return nil
}

func TestWorkerLogLinesNameTheWorkerAndTheTask(t *testing.T) {
	task := jsonTask(1<<63|7, `{}`)
	task.Attempt = 3
	srv := newWorkServer(task)
	srv.refuse[task.GetId()] = true
	logs := &jsonLogs{}
	addr := serve(t, func(s *grpc.Server) { cronoqv1.RegisterWorkerServiceServer(s, srv) })
	w, err := NewWorker(WorkerOptions{
		Options: Options{Endpoint: "http://" + addr, Retry: fastRetry(), Logger: slog.New(slog.NewJSONHandler(logs, nil))},
		Pools:   []string{"default"},
	}, func(context.Context, *Task) (any, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run(context.Background()) }()
	waitFor(t, "the refused outcome's warning", func() bool { return logs.find("cronoq: outcome refused") != nil })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	line := logs.find("cronoq: outcome refused")
	want := map[string]any{"level": "WARN", "worker_id": "w-1", "task_id": "9223372036854775815", "attempt": 3.0, "pool": "default",
		"code": "FAILED_PRECONDITION", "message": "the attempt is not current"}
	for k, v := range want {
		if line[k] != v {
			t.Errorf("%s: %#v, want %#v (the line: %v)", k, line[k], v, line)
		}
	}
	if line := logs.find("cronoq: worker registered"); line == nil || line["worker_id"] != "w-1" {
		t.Errorf("the registration's line %v, want worker_id w-1", line)
	}
}

func TestWorkerSendsAnErrorTextThatIsNotUTF8(t *testing.T) {
	exporter := recordSpans(t)
	srv := newWorkServer(jsonTask(1, `{}`), jsonTask(2, `{}`))
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 1}, func(ctx context.Context, task *Task) (any, error) {
		if task.GetId() == 1 {
			return nil, errors.New("bad \xff\xfe input \xc3")
		}
		return nil, &SnoozeError{Duration: time.Second, Reason: "not \xff UTF-8"} // not from Snooze: not checked
	})
	waitFor(t, "both outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if f := srv.outcome(1).GetFailure(); f.GetError() != "bad \uFFFD input \uFFFD" || !f.GetRetryable() {
		t.Errorf("the failure %v, want its text with U+FFFD for each invalid sequence", srv.outcome(1))
	}
	if f := srv.outcome(2).GetFailure(); !strings.HasSuffix(f.GetError(), "snooze: the reason is not valid UTF-8") {
		t.Errorf("an invalid snooze: %v", srv.outcome(2))
	}
	for _, s := range taskSpans(exporter) {
		if !utf8.ValidString(s.Status.Description) {
			t.Errorf("span status %q is not UTF-8", s.Status.Description)
		}
	}
	// Every string of an outcome: a release, a cancel, a snooze, a report's progress.
	o := &cronoqv1.TaskOutcome{Outcome: &cronoqv1.TaskOutcome_Snoozed{Snoozed: &cronoqv1.TaskSnoozed{Reason: "\xff"}},
		Report: &cronoqv1.TaskReport{Progress: &cronoqv1.TaskProgress{Message: "a\xffb"}}}
	validUTF8(o)
	if o.GetSnoozed().GetReason() != "\uFFFD" || o.GetReport().GetProgress().GetMessage() != "a\uFFFDb" {
		t.Errorf("%v", o)
	}
	for _, o := range []*cronoqv1.TaskOutcome{
		{Outcome: &cronoqv1.TaskOutcome_Released{Released: &cronoqv1.TaskReleased{Reason: "\xff"}}},
		{Outcome: &cronoqv1.TaskOutcome_Cancelled{Cancelled: &cronoqv1.TaskCancelled{Reason: "\xff"}}},
		{Outcome: &cronoqv1.TaskOutcome_Success{Success: &cronoqv1.TaskSuccess{ContentType: "\xff"}}},
	} {
		validUTF8(o)
		if _, err := proto.Marshal(o); err != nil {
			t.Errorf("%v: %v", o, err)
		}
	}
}
