package cronoq

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// opsServer answers the day-2 calls and records each request; unavailable makes the first
// that many calls fail UNAVAILABLE.
type opsServer struct {
	cronoqv1.UnimplementedTaskServiceServer
	cronoqv1.UnimplementedAdminServiceServer
	cronoqv1.UnimplementedScheduleServiceServer
	cronoqv1.UnimplementedWorkerServiceServer
	mu          sync.Mutex
	requests    []proto.Message
	unavailable int
}

func (s *opsServer) record(req proto.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.requests = append(s.requests, req)
	if s.unavailable > 0 {
		s.unavailable--
		return status.Error(codes.Unavailable, "scripted outage")
	}
	return nil
}

func (s *opsServer) last() proto.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.requests[len(s.requests)-1]
}

func (s *opsServer) GetTask(_ context.Context, req *cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	resp := &cronoqv1.GetTaskResponse{Task: &cronoqv1.Task{Id: 7, State: TaskStateFailed}}
	if req.GetIncludeAttempts() {
		resp.Attempts = []*cronoqv1.Attempt{
			{Attempt: 1, Outcome: AttemptOutcomeFailed, Error: "boom"},
			{Attempt: 2, Outcome: AttemptOutcomeRunning},
		}
	}
	if req.GetIncludeChildren() {
		resp.Children = []*cronoqv1.Task{{Id: 8, ParentId: 7}, {Id: 9, ParentId: 7}}
	}
	if req.GetIncludeDependencyResults() {
		resp.Task.DependencyResults = []*cronoqv1.DependencyResult{{Id: 6, State: TaskStateFailed, Error: "boom"}}
	}
	return resp, nil
}

func (s *opsServer) CancelTask(_ context.Context, req *cronoqv1.CancelTaskRequest) (*cronoqv1.CancelTaskResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	resp := &cronoqv1.CancelTaskResponse{Task: &cronoqv1.Task{Id: 7, State: TaskStateCancelled}}
	if req.GetIncludeDescendants() {
		resp.DescendantsCancelled = 4
	}
	return resp, nil
}

func (s *opsServer) ListTasks(_ context.Context, req *cronoqv1.ListTasksRequest) (*cronoqv1.ListTasksResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.ListTasksResponse{Tasks: []*cronoqv1.Task{{Id: 8, ParentId: 7}}}, nil
}

func (s *opsServer) SubmitTask(_ context.Context, req *cronoqv1.SubmitTaskRequest) (*cronoqv1.SubmitTaskResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	replaced := req.GetKeyMode() == KeyModeReplacePending || req.GetKeyMode() == KeyModeDebounce
	return &cronoqv1.SubmitTaskResponse{Task: &cronoqv1.Task{Id: 7, Pool: req.GetPool(), GroupKey: req.GetGroupKey()}, Replaced: replaced}, nil
}

func (s *opsServer) SubmitBatch(_ context.Context, req *cronoqv1.SubmitBatchRequest) (*cronoqv1.SubmitBatchResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	resp := &cronoqv1.SubmitBatchResponse{}
	for i, task := range req.GetTasks() {
		resp.Tasks = append(resp.Tasks, &cronoqv1.Task{Id: uint64(10 + i), Pool: task.GetPool(), GroupKey: task.GetGroupKey()})
		if task.GetKeyMode() == KeyModeReplacePending || task.GetKeyMode() == KeyModeDebounce {
			resp.ReplacedIds = append(resp.ReplacedIds, uint64(10+i))
		}
	}
	return resp, nil
}

func (s *opsServer) RetryTask(_ context.Context, req *cronoqv1.RetryTaskRequest) (*cronoqv1.RetryTaskResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	if req.GetTask().GetKey() == "missing" {
		return nil, status.Error(codes.NotFound, "no task with key missing")
	}
	return &cronoqv1.RetryTaskResponse{Task: &cronoqv1.Task{Id: 7, State: TaskStatePending}, DependentsRestored: 2}, nil
}

func (s *opsServer) DeleteTask(_ context.Context, req *cronoqv1.DeleteTaskRequest) (*cronoqv1.DeleteTaskResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.DeleteTaskResponse{Id: uint64(1)<<63 | 9}, nil
}

var opsShards = []*cronoqv1.BulkShardResult{{Shard: "cpu", Matched: 2, Changed: 1, Incomplete: true}, {Shard: "gpu", Matched: 1, Changed: 1}}

func (s *opsServer) CancelTasks(_ context.Context, req *cronoqv1.CancelTasksRequest) (*cronoqv1.CancelTasksResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.CancelTasksResponse{Matched: 3, Changed: 2, Shards: opsShards, UnavailableShards: []string{"tpu"}, Incomplete: true}, nil
}

func (s *opsServer) RetryTasks(_ context.Context, req *cronoqv1.RetryTasksRequest) (*cronoqv1.RetryTasksResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.RetryTasksResponse{Matched: 3, Changed: 2, Shards: opsShards, UnavailableShards: []string{"tpu"}, Incomplete: true}, nil
}

func (s *opsServer) DeleteTasks(_ context.Context, req *cronoqv1.DeleteTasksRequest) (*cronoqv1.DeleteTasksResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.DeleteTasksResponse{Matched: 3, Changed: 2, Shards: opsShards, UnavailableShards: []string{"tpu"}, Incomplete: true}, nil
}

func (s *opsServer) PausePool(_ context.Context, req *cronoqv1.PausePoolRequest) (*cronoqv1.PausePoolResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.PausePoolResponse{Pause: &cronoqv1.PoolPause{
		Pool: req.GetPool(), Paused: true, PausedAt: timestamppb.New(time.Unix(1700000000, 0)), PausedBy: "token:ops",
	}}, nil
}

func (s *opsServer) ResumePool(_ context.Context, req *cronoqv1.ResumePoolRequest) (*cronoqv1.ResumePoolResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.ResumePoolResponse{Pause: &cronoqv1.PoolPause{Pool: req.GetPool()}}, nil
}

var opsNextFire = timestamppb.New(time.Date(2030, 1, 1, 2, 0, 0, 0, time.UTC))

func (s *opsServer) PutSchedule(_ context.Context, req *cronoqv1.PutScheduleRequest) (*cronoqv1.PutScheduleResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	if req.GetSchedule().GetCron() == "" {
		return nil, status.Error(codes.InvalidArgument, `schedule.cron: "" is not a cron expression`)
	}
	stored := proto.Clone(req.GetSchedule()).(*cronoqv1.Schedule)
	stored.NextFireAt = opsNextFire
	return &cronoqv1.PutScheduleResponse{Schedule: stored}, nil
}

func (s *opsServer) DeleteSchedule(_ context.Context, req *cronoqv1.DeleteScheduleRequest) (*cronoqv1.DeleteScheduleResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	if req.GetName() == "missing" {
		return nil, status.Error(codes.NotFound, "no schedule missing in pool "+req.GetPool())
	}
	return &cronoqv1.DeleteScheduleResponse{}, nil
}

func (s *opsServer) ListSchedules(_ context.Context, req *cronoqv1.ListSchedulesRequest) (*cronoqv1.ListSchedulesResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.ListSchedulesResponse{
		Schedules:         []*cronoqv1.Schedule{{Pool: "llm", Name: "nightly", Cron: "0 2 * * *", NextFireAt: opsNextFire}},
		UnavailableShards: []string{"tpu"},
	}, nil
}

func (s *opsServer) ListWorkers(_ context.Context, req *cronoqv1.ListWorkersRequest) (*cronoqv1.ListWorkersResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	if req.GetPool() == "forbidden" {
		return nil, status.Error(codes.PermissionDenied, "no read permission on pool forbidden")
	}
	return &cronoqv1.ListWorkersResponse{
		Workers:           []*cronoqv1.Worker{{Id: "w-1", Pools: []string{"llm"}, Shard: "gpu", Concurrency: 8, Running: 3}},
		UnavailableShards: []string{"tpu"},
	}, nil
}

func (s *opsServer) GetSnapshot(_ context.Context, req *cronoqv1.GetSnapshotRequest) (*cronoqv1.GetSnapshotResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.GetSnapshotResponse{
		Shards:            []*cronoqv1.ShardSnapshot{{Shard: "cpu", Number: 0, Term: 3}, {Shard: "gpu", Number: 1, Leader: "http://gpu:7070"}},
		UnavailableShards: []string{"tpu"},
	}, nil
}

func (s *opsServer) GetServerInfo(_ context.Context, req *cronoqv1.GetServerInfoRequest) (*cronoqv1.GetServerInfoResponse, error) {
	if err := s.record(req); err != nil {
		return nil, err
	}
	return &cronoqv1.GetServerInfoResponse{Version: "0.2.0", Shard: "cpu", Role: cronoqv1.Role_ROLE_LEADER, Term: 3}, nil
}

func opsClient(t *testing.T, srv *opsServer) *Client {
	t.Helper()
	addr := serve(t, func(s *grpc.Server) {
		cronoqv1.RegisterTaskServiceServer(s, srv)
		cronoqv1.RegisterAdminServiceServer(s, srv)
		cronoqv1.RegisterScheduleServiceServer(s, srv)
		cronoqv1.RegisterWorkerServiceServer(s, srv)
	})
	client, err := NewClient(Options{Endpoint: "http://" + addr, Retry: fastRetry(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	return client
}

func wantRequest(t *testing.T, got, want proto.Message) {
	t.Helper()
	if !proto.Equal(got, want) {
		t.Errorf("request %v, want %v", got, want)
	}
}

func TestRetrySendsRunAtAndExtraAttemptsAndIsRetriedOnUnavailable(t *testing.T) {
	srv := &opsServer{unavailable: 1} // as Cancel: UNAVAILABLE is retried
	client := opsClient(t, srv)
	runAt := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	retried, err := client.Retry(context.Background(), ByKey("op-fail"), RetryOptions{RunAt: runAt, ExtraAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	if retried.Task.GetState() != TaskStatePending || retried.DependentsRestored != 2 || len(srv.requests) != 2 {
		t.Errorf("%v after %d calls", retried, len(srv.requests))
	}
	wantRequest(t, srv.last(), &cronoqv1.RetryTaskRequest{
		Task: &cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Key{Key: "op-fail"}}, RunAt: timestamppb.New(runAt), ExtraAttempts: 3,
	})

	// No options: now, and the server's default of extra attempts.
	if _, err := client.Retry(context.Background(), ByID(7), RetryOptions{}); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.RetryTaskRequest{Task: &cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Id{Id: 7}}})

	// Delay: not before now + Delay.
	before := time.Now()
	if _, err := client.Retry(context.Background(), ByID(7), RetryOptions{Delay: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if at := srv.last().(*cronoqv1.RetryTaskRequest).GetRunAt().AsTime(); at.Before(before.Add(time.Hour)) || at.After(time.Now().Add(time.Hour)) {
		t.Errorf("run_at %v, want an hour from %v", at, before)
	}

	if _, err := client.Retry(context.Background(), ByKey("missing"), RetryOptions{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("a missing key: %v, want ErrNotFound", err)
	}
	if _, err := client.Retry(context.Background(), TaskRef{}, RetryOptions{}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no ref: %v, want ErrInvalidArgument", err)
	}
}

func TestDeleteReturnsTheIDDeleted(t *testing.T) {
	srv := &opsServer{}
	client := opsClient(t, srv)
	id, err := client.Delete(context.Background(), ByKey("op-done"))
	if err != nil || id != uint64(1)<<63|9 {
		t.Fatalf("id %d, err %v", id, err)
	}
	wantRequest(t, srv.last(), &cronoqv1.DeleteTaskRequest{Task: &cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Key{Key: "op-done"}}})
}

func TestGetWithAttempts(t *testing.T) {
	srv := &opsServer{}
	client := opsClient(t, srv)
	got, err := client.GetWithAttempts(context.Background(), ByID(7))
	if err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.GetTaskRequest{Task: &cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Id{Id: 7}}, IncludeAttempts: true})
	if got.Task.GetId() != 7 || len(got.Attempts) != 2 || got.Attempts[0].GetError() != "boom" ||
		got.Attempts[1].GetOutcome() != AttemptOutcomeRunning {
		t.Errorf("%v", got)
	}
	// Get asks for no attempts.
	if _, err := client.Get(context.Background(), ByID(7)); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.GetTaskRequest{Task: &cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Id{Id: 7}}})
}

func TestBulkActionsSendTheFilterAndReadEveryShard(t *testing.T) {
	srv := &opsServer{}
	client := opsClient(t, srv)
	ctx := context.Background()
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	filter := TaskFilter{
		Pool: "llm", States: []TaskState{TaskStateFailed}, CreatedAfter: t0, CreatedBefore: t0.Add(time.Hour),
		FinishedAfter: t0.Add(2 * time.Hour), FinishedBefore: t0.Add(3 * time.Hour),
		KeyPrefix: "op-", ErrorContains: "boom", IDs: []uint64{uint64(1)<<63 | 1, 2},
	}
	wantFilter := &cronoqv1.TaskFilter{
		Pool: "llm", States: []TaskState{TaskStateFailed}, CreatedAfter: timestamppb.New(t0), CreatedBefore: timestamppb.New(t0.Add(time.Hour)),
		FinishedAfter: timestamppb.New(t0.Add(2 * time.Hour)), FinishedBefore: timestamppb.New(t0.Add(3 * time.Hour)),
		KeyPrefix: "op-", ErrorContains: "boom", Ids: []uint64{uint64(1)<<63 | 1, 2},
	}
	check := func(what string, res *BulkResult, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if res.Matched != 3 || res.Changed != 2 || !res.Incomplete || len(res.Shards) != 2 || !res.Shards[0].GetIncomplete() || res.Shards[1].GetShard() != "gpu" ||
			len(res.UnavailableShards) != 1 || res.UnavailableShards[0] != "tpu" {
			t.Errorf("%s: %+v", what, res)
		}
	}

	res, err := client.CancelTasks(ctx, filter, BulkOptions{DryRun: true})
	check("cancel", res, err)
	wantRequest(t, srv.last(), &cronoqv1.CancelTasksRequest{Filter: wantFilter, DryRun: true})

	runAt := t0.Add(24 * time.Hour)
	res, err = client.RetryTasks(ctx, filter, BulkRetryOptions{RetryOptions: RetryOptions{RunAt: runAt, ExtraAttempts: 2}})
	check("retry", res, err)
	wantRequest(t, srv.last(), &cronoqv1.RetryTasksRequest{Filter: wantFilter, RunAt: timestamppb.New(runAt), ExtraAttempts: 2})

	res, err = client.DeleteTasks(ctx, TaskFilter{KeyPrefix: "op-"}, BulkOptions{})
	check("delete", res, err)
	wantRequest(t, srv.last(), &cronoqv1.DeleteTasksRequest{Filter: &cronoqv1.TaskFilter{KeyPrefix: "op-"}})
}

func TestPauseAndResumePool(t *testing.T) {
	srv := &opsServer{unavailable: 1}
	client := opsClient(t, srv)
	pause, err := client.PausePool(context.Background(), "llm")
	if err != nil {
		t.Fatal(err)
	}
	if pause.GetPool() != "llm" || !pause.GetPaused() || pause.GetPausedBy() != "token:ops" ||
		!pause.GetPausedAt().AsTime().Equal(time.Unix(1700000000, 0)) || len(srv.requests) != 2 {
		t.Errorf("%v after %d calls", pause, len(srv.requests))
	}
	wantRequest(t, srv.last(), &cronoqv1.PausePoolRequest{Pool: "llm"})
	pause, err = client.ResumePool(context.Background(), "llm")
	if err != nil || pause.GetPool() != "llm" || pause.GetPaused() || pause.GetPausedAt() != nil {
		t.Errorf("%v, %v", pause, err)
	}
	wantRequest(t, srv.last(), &cronoqv1.ResumePoolRequest{Pool: "llm"})
}

func TestSubmitAndSubmitBatchSendTheGroupKey(t *testing.T) {
	srv := &opsServer{}
	client := opsClient(t, srv)
	ctx := context.Background()

	sub, err := client.Submit(ctx, TaskSpec{Pool: "default", GroupKey: "tenant-a"})
	if err != nil {
		t.Fatal(err)
	}
	if got := srv.last().(*cronoqv1.SubmitTaskRequest).GetGroupKey(); got != "tenant-a" {
		t.Errorf("SubmitTask group_key %q, want tenant-a", got)
	}
	if sub.Task.GetGroupKey() != "tenant-a" {
		t.Errorf("submitted task's group_key %q, want tenant-a", sub.Task.GetGroupKey())
	}

	if _, err := client.SubmitBatch(ctx, []TaskSpec{{Pool: "default", GroupKey: "tenant-b"}, {Pool: "default"}}); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, task := range srv.last().(*cronoqv1.SubmitBatchRequest).GetTasks() {
		keys = append(keys, task.GetGroupKey())
	}
	if len(keys) != 2 || keys[0] != "tenant-b" || keys[1] != "" { // none given: no group
		t.Errorf("SubmitBatch group_keys %q, want [tenant-b \"\"]", keys)
	}
}

func TestSubmitAndSubmitBatchSendTheKeyModeAndAnswerReplaced(t *testing.T) {
	srv := &opsServer{}
	client := opsClient(t, srv)
	ctx := context.Background()
	startBy := time.Now().Add(time.Hour).Truncate(time.Millisecond)
	debounce := TaskSpec{Pool: "default", Key: "sync-user-1", KeyMode: KeyModeDebounce, Debounce: 2 * time.Second,
		MaxDebounce: time.Minute, KeyTTL: time.Hour, StartBy: startBy}

	sub, err := client.Submit(ctx, debounce)
	if err != nil {
		t.Fatal(err)
	}
	sent := proto.Clone(srv.last()).(*cronoqv1.SubmitTaskRequest)
	sent.RequestId = ""
	wantRequest(t, sent, &cronoqv1.SubmitTaskRequest{Pool: "default", Key: "sync-user-1", KeyMode: KeyModeDebounce,
		DebounceMs: 2000, MaxDebounceMs: 60_000, KeyTtlMs: 3_600_000, StartBy: timestamppb.New(startBy)})
	if !sub.Replaced || sub.Deduplicated {
		t.Errorf("submitted %+v, want Replaced", sub)
	}
	if sub, err = client.Submit(ctx, TaskSpec{Pool: "default", Key: "sync-user-1"}); err != nil || sub.Replaced {
		t.Errorf("submitted %+v, %v: want not Replaced", sub, err)
	}

	batch, err := client.SubmitBatch(ctx, []TaskSpec{{Pool: "default"}, debounce})
	if err != nil {
		t.Fatal(err)
	}
	if got := srv.last().(*cronoqv1.SubmitBatchRequest).GetTasks()[1]; got.GetKeyMode() != KeyModeDebounce || got.GetDebounceMs() != 2000 ||
		got.GetKeyTtlMs() != 3_600_000 || !got.GetStartBy().AsTime().Equal(startBy) {
		t.Errorf("SubmitBatch sent %v", got)
	}
	if ids := batch.GetReplacedIds(); len(ids) != 1 || ids[0] != 11 {
		t.Errorf("replaced ids %v, want [11]", ids)
	}
}

func TestWorkflowCalls(t *testing.T) {
	srv := &opsServer{unavailable: 1}
	client := opsClient(t, srv)
	ctx := context.Background()
	byID := &cronoqv1.TaskRef{Ref: &cronoqv1.TaskRef_Id{Id: 7}}

	// A finalizer: run_when and depends_on reach SubmitTask (and SubmitBatch).
	spec := TaskSpec{Pool: "default", DependsOn: []TaskRef{ByKey("wf-a"), ByID(6)}, RunWhen: RunWhenDependenciesEnded}
	if _, err := client.Submit(ctx, spec); err != nil {
		t.Fatal(err)
	}
	sent := srv.last().(*cronoqv1.SubmitTaskRequest)
	wantRequest(t, &cronoqv1.SubmitTaskRequest{Pool: sent.GetPool(), DependsOn: sent.GetDependsOn(), RunWhen: sent.GetRunWhen()},
		&cronoqv1.SubmitTaskRequest{Pool: "default", RunWhen: RunWhenDependenciesEnded,
			DependsOn: []*cronoqv1.TaskRef{{Ref: &cronoqv1.TaskRef_Key{Key: "wf-a"}}, {Ref: &cronoqv1.TaskRef_Id{Id: 6}}}})
	if _, err := client.SubmitBatch(ctx, []TaskSpec{spec}); err != nil {
		t.Fatal(err)
	}
	if got := srv.last().(*cronoqv1.SubmitBatchRequest).GetTasks()[0].GetRunWhen(); got != RunWhenDependenciesEnded {
		t.Errorf("SubmitBatch run_when %v", got)
	}

	got, err := client.GetWith(ctx, ByID(7), GetOptions{IncludeChildren: true, IncludeDependencyResults: true})
	if err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.GetTaskRequest{Task: byID, IncludeChildren: true, IncludeDependencyResults: true})
	if len(got.Children) != 2 || got.Children[1].GetParentId() != 7 || got.Attempts != nil {
		t.Errorf("children: %v", got)
	}
	if deps := DependencyResultsOf(got.Task); len(deps) != 1 || deps[0].ID != 6 || deps[0].Error != "boom" {
		t.Errorf("dependency results: %+v", deps)
	}
	if _, err := client.GetWith(ctx, ByID(7), GetOptions{IncludeAttempts: true}); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.GetTaskRequest{Task: byID, IncludeAttempts: true})

	cancelled, err := client.CancelWith(ctx, ByID(7), CancelOptions{IncludeDescendants: true})
	if err != nil || cancelled.Task.GetState() != TaskStateCancelled || cancelled.DescendantsCancelled != 4 {
		t.Fatalf("%v, %v", cancelled, err)
	}
	wantRequest(t, srv.last(), &cronoqv1.CancelTaskRequest{Task: byID, IncludeDescendants: true})
	if task, err := client.Cancel(ctx, ByID(7)); err != nil || task.GetId() != 7 {
		t.Fatalf("%v, %v", task, err)
	}
	wantRequest(t, srv.last(), &cronoqv1.CancelTaskRequest{Task: byID})

	// The children of a task, listed and acted on by filter.
	if _, err := client.List(ctx, ListOptions{Filter: &TaskFilter{ParentID: 7}}); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.ListTasksRequest{PageSize: 100, Filter: &cronoqv1.TaskFilter{ParentId: 7}})
	if _, err := client.CancelTasks(ctx, TaskFilter{ParentID: 7}, BulkOptions{DryRun: true}); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.CancelTasksRequest{Filter: &cronoqv1.TaskFilter{ParentId: 7}, DryRun: true})
}

func TestPutScheduleSendsTheSpecAsSubmitDoesAndReturnsTheStoredSchedule(t *testing.T) {
	srv := &opsServer{unavailable: 1} // UNAVAILABLE is retried, as for every call
	client := opsClient(t, srv)
	tid, _ := trace.TraceIDFromHex("0af7651916cd43dd8448eb211c80319c")
	sid, _ := trace.SpanIDFromHex("b7ad6b7169203331")
	ctx := trace.ContextWithRemoteSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true}))
	spec := ScheduleSpec{
		Pool: "llm", Name: "nightly", Cron: "0 2 * * *", Timezone: "Europe/Paris", Payload: map[string]int{"n": 1},
		Priority: 5, MaxAttempts: 3, Resources: map[string]int64{"gpu": 1}, Timeout: 90 * time.Second,
		GroupKey: "tenant-a", Paused: true, FireAllMissed: true,
	}
	schedule, err := client.PutSchedule(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	want := &cronoqv1.Schedule{
		Pool: "llm", Name: "nightly", Cron: "0 2 * * *", Timezone: "Europe/Paris", Payload: []byte(`{"n":1}`),
		ContentType: JSONContentType, Priority: 5, MaxAttempts: 3, Resources: map[string]int64{"gpu": 1}, TimeoutMs: 90_000,
		GroupKey: "tenant-a", Paused: true, FireAllMissed: true,
		Trace: &cronoqv1.TraceContext{Traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
	}
	wantRequest(t, srv.last(), &cronoqv1.PutScheduleRequest{Schedule: want})
	if len(srv.requests) != 2 || schedule.GetName() != "nightly" || !proto.Equal(schedule.GetNextFireAt(), opsNextFire) {
		t.Errorf("%v after %d calls", schedule, len(srv.requests))
	}

	// A trace context given is sent instead of ctx's; bytes are sent as they are.
	given := &cronoqv1.TraceContext{Traceparent: "00-11111111111111111111111111111111-2222222222222222-01"}
	if _, err := client.PutSchedule(ctx, ScheduleSpec{Pool: "llm", Name: "raw", Cron: "* * * * *", Payload: []byte{1, 2}, Trace: given}); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.PutScheduleRequest{Schedule: &cronoqv1.Schedule{
		Pool: "llm", Name: "raw", Cron: "* * * * *", Payload: []byte{1, 2}, Trace: given,
	}})
	// No span context, no payload: neither is sent.
	if _, err := client.PutSchedule(context.Background(), ScheduleSpec{Pool: "llm", Name: "bare", Cron: "* * * * *"}); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.PutScheduleRequest{Schedule: &cronoqv1.Schedule{Pool: "llm", Name: "bare", Cron: "* * * * *"}})

	// The server parses the cron: its refusal is the SDK's ErrInvalidArgument, with its message.
	_, err = client.PutSchedule(context.Background(), ScheduleSpec{Pool: "llm", Name: "bad"})
	var e *Error
	if !errors.Is(err, ErrInvalidArgument) || !errors.As(err, &e) || e.Message != `schedule.cron: "" is not a cron expression` {
		t.Errorf("an empty cron: %v, want the server's ErrInvalidArgument", err)
	}
	// A payload JSON cannot encode is refused before any call.
	calls := len(srv.requests)
	if _, err := client.PutSchedule(context.Background(), ScheduleSpec{Pool: "llm", Name: "x", Cron: "* * * * *", Payload: make(chan int)}); !errors.Is(err, ErrInvalidArgument) ||
		!strings.HasPrefix(err.Error(), "INVALID_ARGUMENT: payload: ") || len(srv.requests) != calls {
		t.Errorf("a channel payload: %v after %d calls", err, len(srv.requests)-calls)
	}
}

func TestDeleteScheduleAndListSchedules(t *testing.T) {
	srv := &opsServer{unavailable: 1}
	client := opsClient(t, srv)
	ctx := context.Background()
	if err := client.DeleteSchedule(ctx, "llm", "nightly"); err != nil || len(srv.requests) != 2 {
		t.Fatalf("%v after %d calls", err, len(srv.requests))
	}
	wantRequest(t, srv.last(), &cronoqv1.DeleteScheduleRequest{Pool: "llm", Name: "nightly"})
	if err := client.DeleteSchedule(ctx, "llm", "missing"); !errors.Is(err, ErrNotFound) {
		t.Errorf("a missing schedule: %v, want ErrNotFound", err)
	}

	listed, err := client.ListSchedules(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.ListSchedulesRequest{})
	if s := listed.GetSchedules(); len(s) != 1 || s[0].GetCron() != "0 2 * * *" || !proto.Equal(s[0].GetNextFireAt(), opsNextFire) ||
		len(listed.GetUnavailableShards()) != 1 || listed.GetUnavailableShards()[0] != "tpu" {
		t.Errorf("%v", listed)
	}
	if _, err := client.ListSchedules(ctx, "llm"); err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.ListSchedulesRequest{Pool: "llm"})
}

func TestListWorkersSnapshotAndServerInfo(t *testing.T) {
	srv := &opsServer{unavailable: 1}
	client := opsClient(t, srv)
	ctx := context.Background()

	workers, err := client.ListWorkers(ctx, "llm")
	if err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.ListWorkersRequest{Pool: "llm"})
	if w := workers.GetWorkers(); len(srv.requests) != 2 || len(w) != 1 || w[0].GetId() != "w-1" || w[0].GetRunning() != 3 ||
		len(workers.GetUnavailableShards()) != 1 {
		t.Errorf("%v after %d calls", workers, len(srv.requests))
	}
	if _, err := client.ListWorkers(ctx, "forbidden"); !errors.Is(err, ErrPermissionDenied) {
		t.Errorf("a pool not readable: %v, want ErrPermissionDenied", err)
	}

	snapshot, err := client.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.GetSnapshotRequest{})
	if s := snapshot.GetShards(); len(s) != 2 || s[0].GetTerm() != 3 || s[1].GetLeader() != "http://gpu:7070" || snapshot.GetUnavailableShards()[0] != "tpu" {
		t.Errorf("%v", snapshot)
	}

	info, err := client.ServerInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantRequest(t, srv.last(), &cronoqv1.GetServerInfoRequest{})
	if info.GetShard() != "cpu" || info.GetRole() != cronoqv1.Role_ROLE_LEADER || info.GetVersion() != "0.2.0" {
		t.Errorf("%v", info)
	}
}
