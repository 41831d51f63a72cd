package cronoq

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// withDependencies is a leased task whose dependencies ended: a JSON result (key wf-a), raw
// bytes (wf-b), a failure with no key.
func withDependencies(id uint64) *cronoqv1.Task {
	task := jsonTask(id, `{}`)
	task.DependencyResults = []*cronoqv1.DependencyResult{
		{Id: 1 << 63, Key: "wf-a", State: TaskStateSucceeded, Result: []byte(`{"n": 2}`), ContentType: JSONContentType},
		{Id: 11, Key: "wf-b", State: TaskStateSucceeded, Result: []byte{0, 0xff}},
		{Id: 12, State: TaskStateFailed, Error: "boom"},
	}
	return task
}

func TestHandlerSeesItsDependencyResults(t *testing.T) {
	srv := newWorkServer(withDependencies(3), jsonTask(4, `{}`))
	seen := map[uint64][]DependencyResult{}
	var failures atomic.Value
	fail := func(format string) { failures.Store(format) }
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 1}, func(ctx context.Context, task *Task) (any, error) {
		tc := TaskContextFrom(ctx)
		seen[task.GetId()] = tc.DependencyResults()
		if task.GetId() != 3 {
			return nil, nil
		}
		a, ok := tc.Dependency("wf-a")
		var in struct{ N int }
		if !ok || a.Decode(&in) != nil || in.N != 2 {
			fail("wf-a by key")
		}
		if b, ok := tc.Dependency(uint64(11)); !ok || b.Key != "wf-b" || string(b.Result) != "\x00\xff" || b.Decode(&in) == nil {
			fail("wf-b by uint64 id: raw bytes, not JSON")
		}
		if f, ok := tc.Dependency(12); !ok || f.State != TaskStateFailed || f.Error != "boom" {
			fail("the failed one by an untyped constant id")
		}
		if a, ok := tc.Dependency(uint64(1 << 63)); !ok || a.Key != "wf-a" {
			fail("a top-bit id")
		}
		for _, absent := range []any{"wf-c", uint64(13), -1, 1.5, nil} {
			if _, ok := tc.Dependency(absent); ok {
				fail("found an absent dependency")
			}
		}
		return nil, nil
	})
	waitFor(t, "2 outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if f := failures.Load(); f != nil {
		t.Error(f)
	}
	got := seen[3]
	if len(got) != 3 || got[0].ID != 1<<63 || got[1].ContentType != "" || got[2].Key != "" || got[2].Result != nil {
		t.Errorf("dependency results in depends_on order: %+v", got)
	}
	if seen[4] != nil {
		t.Errorf("a task without dependencies: %+v", seen[4])
	}
	if TaskContextFrom(context.Background()).DependencyResults() != nil {
		t.Error("no handler: dependency results")
	}
}

func TestSpawnIsSentWithTheSuccessOnly(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{}`), jsonTask(2, `{"fail": true}`), jsonTask(3, `{"snooze": true}`))
	var late atomic.Pointer[TaskContext]
	w, done := startWorker(t, srv, WorkerOptions{Concurrency: 1}, func(ctx context.Context, task *Task) (any, error) {
		tc := TaskContextFrom(ctx)
		for i, n := range []int{1, 2} {
			if err := tc.Spawn("default", map[string]int{"n": n}, SpawnKey([]string{"c1", "c2"}[i])); err != nil {
				return nil, err
			}
		}
		join := []SpawnOption{SpawnDependsOn(ByKey("c1"), ByKey("c2")), SpawnDependsOn(ByID(task.GetId())),
			SpawnRunWhen(RunWhenDependenciesEnded), SpawnKey("join"), func(s *TaskSpec) { s.Priority = 5 }}
		if err := tc.Spawn("llm", []byte("raw"), join...); err != nil {
			return nil, err
		}
		late.Store(tc)
		var in map[string]bool
		_ = DecodePayload(task, &in)
		switch {
		case in["fail"]:
			return nil, errors.New("failed after spawning")
		case in["snooze"]:
			return nil, Snooze(time.Hour, "later")
		}
		return "spawned", nil
	})
	waitFor(t, "3 outcomes", func() bool { return w.Processed() == 3 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	success := srv.outcome(1).GetSuccess()
	want := []*cronoqv1.SubmitTaskRequest{
		{Pool: "default", Key: "c1", Payload: []byte(`{"n":1}`), ContentType: JSONContentType},
		{Pool: "default", Key: "c2", Payload: []byte(`{"n":2}`), ContentType: JSONContentType},
		{Pool: "llm", Key: "join", Payload: []byte("raw"), Priority: 5, RunWhen: RunWhenDependenciesEnded, DependsOn: []*cronoqv1.TaskRef{
			{Ref: &cronoqv1.TaskRef_Key{Key: "c1"}}, {Ref: &cronoqv1.TaskRef_Key{Key: "c2"}}, {Ref: &cronoqv1.TaskRef_Id{Id: 1}},
		}},
	}
	if success == nil || string(success.GetResult()) != `"spawned"` || len(success.GetSpawn()) != len(want) {
		t.Fatalf("outcome of the spawning task: %v", srv.outcome(1))
	}
	for i, req := range success.GetSpawn() {
		if !proto.Equal(req, want[i]) {
			t.Errorf("spawn %d: %v, want %v", i, req, want[i])
		}
	}
	if f := srv.outcome(2).GetFailure(); f == nil || f.GetError() != "failed after spawning" {
		t.Errorf("a failure carries no spawn: %v", srv.outcome(2))
	}
	if srv.outcome(3).GetSnoozed() == nil {
		t.Errorf("a snooze carries no spawn: %v", srv.outcome(3))
	}
	if err := late.Load().Spawn("default", nil); !errors.Is(err, ErrFailedPrecondition) {
		t.Errorf("a spawn after the handler returned: %v, want ErrFailedPrecondition", err)
	}
}

func TestSpawnRefusesWhatCouldNotBeSent(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{}`))
	errs := make(chan []error, 1)
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		tc := TaskContextFrom(ctx)
		errs <- []error{
			tc.Spawn("default", make(chan int)),
			tc.Spawn("default", nil, SpawnKey("bad\xff")),
			tc.Spawn("default", nil, SpawnDependsOn(TaskRef{})),
		}
		return nil, nil
	})
	waitFor(t, "the outcome", func() bool { return w.Processed() == 1 })
	w.Stop()
	<-done
	for i, err := range <-errs {
		if !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("refusal %d: %v, want ErrInvalidArgument", i, err)
		}
	}
	if s := srv.outcome(1).GetSuccess(); s == nil || len(s.GetSpawn()) != 0 {
		t.Errorf("nothing refused is sent: %v", srv.outcome(1))
	}
	if err := TaskContextFrom(context.Background()).Spawn("default", nil); !errors.Is(err, errNotAHandler) {
		t.Errorf("no handler: %v", err)
	}
}

func TestSpawnOfALostAttemptIsNeverSent(t *testing.T) {
	srv := newWorkServer(jsonTask(51, `{}`))
	srv.lost[51] = true
	spawned := make(chan error, 1)
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		<-ctx.Done() // the heartbeat's answer said the lease is lost
		spawned <- TaskContextFrom(ctx).Spawn("default", map[string]int{"n": 1})
		return "done anyway", nil
	})
	if err := <-spawned; err != nil {
		t.Fatalf("a spawn while the handler still runs: %v", err)
	}
	time.Sleep(300 * time.Millisecond) // a few heartbeats and outcome lingers
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if o := srv.outcome(51); o != nil {
		t.Errorf("a lost attempt's outcome was sent: %v", o)
	}
}

func TestASpawnTooLargeForAMessageFailsTheAttempt(t *testing.T) {
	payload := make([]byte, mib) // shared: 70 requests of 1 MiB, over a message's limit
	var spawned []*cronoqv1.SubmitTaskRequest
	for range 70 {
		spawned = append(spawned, &cronoqv1.SubmitTaskRequest{Pool: "default", Payload: payload})
	}
	outcome := &cronoqv1.TaskOutcome{TaskId: 1, Attempt: 1, Outcome: &cronoqv1.TaskOutcome_Success{Success: &cronoqv1.TaskSuccess{}}}
	withSpawned(outcome, spawned)
	if f := outcome.GetFailure(); f == nil || f.GetRetryable() || !strings.Contains(f.GetError(), "70 spawned tasks") {
		t.Errorf("outcome %v", outcome)
	}
	outcome.Outcome = &cronoqv1.TaskOutcome_Success{Success: &cronoqv1.TaskSuccess{}}
	withSpawned(outcome, spawned[:2])
	if len(outcome.GetSuccess().GetSpawn()) != 2 {
		t.Errorf("two that fit: %v", outcome)
	}
}

func TestSpawnedTasksCarryTheHandlersTrace(t *testing.T) {
	traced := jsonTask(1, `{}`)
	traced.Trace = &cronoqv1.TraceContext{Traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	srv := newWorkServer(traced, jsonTask(2, `{}`))
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		return nil, TaskContextFrom(ctx).Spawn("default", nil)
	})
	waitFor(t, "2 outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	<-done
	// No TracerProvider: the handler's span is the submitter's, which its children carry.
	if got := srv.outcome(1).GetSuccess().GetSpawn()[0].GetTrace().GetTraceparent(); !strings.Contains(got, "0af7651916cd43dd8448eb211c80319c") {
		t.Errorf("a traced task's child: traceparent %q", got)
	}
	if got := srv.outcome(2).GetSuccess().GetSpawn()[0].GetTrace(); got != nil {
		t.Errorf("an untraced task's child: %v", got)
	}
}
