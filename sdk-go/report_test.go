package cronoq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

func TestSnoozeChecksItsDuration(t *testing.T) {
	for _, d := range []time.Duration{0, time.Millisecond, math.MaxUint32 * time.Millisecond, math.MaxUint32*time.Millisecond + 999*time.Microsecond} {
		var s *SnoozeError
		if err := Snooze(d, "later"); !errors.As(err, &s) || s.Duration != d || s.Reason != "later" {
			t.Errorf("Snooze(%v): %v", d, err)
		}
	}
	for _, d := range []time.Duration{-time.Nanosecond, (math.MaxUint32 + 1) * time.Millisecond} {
		var s *SnoozeError
		if err := Snooze(d, ""); !errors.Is(err, ErrInvalidArgument) || errors.As(err, &s) {
			t.Errorf("Snooze(%v): %v, want ErrInvalidArgument", d, err)
		}
	}
	if err := Snooze(time.Second, "\xff"); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a reason that is not UTF-8: %v", err)
	}
}

func TestWorkerReportsASnooze(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{}`), jsonTask(2, `{}`), jsonTask(3, `{}`), jsonTask(4, `{}`))
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		switch task.GetId() {
		case 1: // rounded down to whole ms, found when wrapped
			return nil, fmt.Errorf("busy: %w", Snooze(1500*time.Millisecond+900*time.Microsecond, "rate limited"))
		case 2:
			return nil, Snooze(0, "")
		case 3:
			return nil, Snooze(-time.Second, "")
		default: // not made by Snooze
			return nil, &SnoozeError{Duration: 50 * 24 * time.Hour}
		}
	})
	waitFor(t, "4 outcomes", func() bool { return w.Processed() == 4 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := srv.outcome(1).GetSnoozed(); s == nil || s.GetSnoozeMs() != 1500 || s.GetReason() != "rate limited" {
		t.Errorf("task 1: %v, want snoozed 1500 ms", srv.outcome(1))
	}
	if s := srv.outcome(2).GetSnoozed(); s == nil || s.GetSnoozeMs() != 0 {
		t.Errorf("task 2: %v, want snoozed 0 ms", srv.outcome(2))
	}
	if f := srv.outcome(3).GetFailure(); f == nil || !strings.Contains(f.GetError(), "snooze: -1s is negative") {
		t.Errorf("task 3: %v, want a failure saying the snooze is negative", srv.outcome(3))
	}
	if f := srv.outcome(4).GetFailure(); f == nil || !strings.Contains(f.GetError(), "more than 4294967295 ms") {
		t.Errorf("task 4: %v, want a failure saying the snooze is too long", srv.outcome(4))
	}
}

func TestWorkerGivesTheHandlerItsCheckpointAndSnoozes(t *testing.T) {
	resumed := jsonTask(1, `{}`)
	resumed.Snoozes, resumed.Checkpoint = 3, []byte("step-7")
	srv := newWorkServer(resumed, jsonTask(2, `{}`))
	type seen struct {
		tc                     *TaskContext
		snoozes                int32
		leased, saved, cleared []byte
	}
	got := make(chan seen, 2)
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		tc := TaskContextFrom(ctx)
		s := seen{tc: tc, snoozes: tc.Snoozes(), leased: tc.Checkpoint()}
		if err := tc.SaveCheckpoint([]byte("step-8")); err != nil {
			return nil, err
		}
		s.saved = tc.Checkpoint()
		if err := tc.SaveCheckpoint(nil); err != nil {
			return nil, err
		}
		s.cleared = tc.Checkpoint()
		got <- s
		return nil, nil
	})
	waitFor(t, "2 outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for range 2 {
		s := <-got
		if s.snoozes == 3 && string(s.leased) != "step-7" || s.snoozes == 0 && s.leased != nil || s.snoozes != 3 && s.snoozes != 0 {
			t.Errorf("leased: snoozes %d, checkpoint %q; want 3 and step-7, or 0 and nil", s.snoozes, s.leased)
		}
		if string(s.saved) != "step-8" || s.cleared != nil {
			t.Errorf("after a save %q, after saving it empty %q; want step-8, then nil", s.saved, s.cleared)
		}
		if err := s.tc.ReportProgress(1, "done"); !errors.Is(err, ErrFailedPrecondition) || !strings.Contains(err.Error(), "its handler has returned") {
			t.Errorf("a report after the handler returned: %v", err)
		}
	}
	// A checkpoint saved empty is sent, and clears the task's.
	if r := srv.outcome(1).GetReport(); r == nil || r.Checkpoint == nil || len(r.Checkpoint) != 0 || r.GetProgress() != nil {
		t.Errorf("the outcome's report %v, want an empty checkpoint", r)
	}
}

func TestWorkerLastReportRidesTheOutcome(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{}`), jsonTask(2, `{}`))
	srv.beatMs = 60_000
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		if task.GetId() == 2 { // nothing reported: no report
			return nil, errors.New("crash")
		}
		tc := TaskContextFrom(ctx)
		if err := tc.SaveCheckpoint([]byte("almost")); err != nil {
			return nil, err
		}
		if err := tc.ReportProgress(0.9, "nearly"); err != nil {
			return nil, err
		}
		return nil, errors.New("crash")
	})
	waitFor(t, "2 outcomes", func() bool { return w.Processed() == 2 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	want := &cronoqv1.TaskReport{TaskId: 1, Attempt: 1, Progress: &cronoqv1.TaskProgress{Value: 0.9, Message: "nearly"}, Checkpoint: []byte("almost")}
	if o := srv.outcome(1); o.GetFailure() == nil || !proto.Equal(o.GetReport(), want) {
		t.Errorf("task 1: %v, want a failure with the report %v", o, want)
	}
	if o := srv.outcome(2); o.GetFailure() == nil || o.GetReport() != nil {
		t.Errorf("task 2: %v, want a failure without a report", o)
	}
}

// A report a heartbeat carried is pending until a heartbeat's answer: the next stream's
// heartbeats carry it again, and the outcome too while none is answered.
func TestWorkerResendsAnUnansweredReport(t *testing.T) {
	srv := newWorkServer(jsonTask(1, `{}`))
	srv.silentBeats, srv.breakOnReport = true, true
	carriedOn := func(stream int) bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		for _, r := range srv.beatReports {
			if r.stream == stream && r.report.GetProgress().GetMessage() == "half" {
				return true
			}
		}
		return false
	}
	finish := make(chan struct{})
	w, done := startWorker(t, srv, WorkerOptions{}, func(ctx context.Context, task *Task) (any, error) {
		if err := TaskContextFrom(ctx).ReportProgress(0.5, "half"); err != nil {
			return nil, err
		}
		<-finish
		return "done", nil
	})
	waitFor(t, "the report in a heartbeat of the second stream", func() bool { return carriedOn(2) })
	close(finish)
	waitFor(t, "the outcome", func() bool { return w.Processed() == 1 })
	w.Stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !carriedOn(1) {
		t.Error("no heartbeat of the first stream carried the report")
	}
	if r := srv.outcome(1).GetReport(); r.GetProgress().GetMessage() != "half" || r.Checkpoint != nil {
		t.Errorf("the outcome's report %v, want the progress sent and not answered", r)
	}
}

// reportingWorker is a worker (not run) with task 9 at attempt 2 running, and its context.
func reportingWorker(t *testing.T) (*Worker, *TaskContext) {
	t.Helper()
	w, err := NewWorker(WorkerOptions{Pools: []string{"default"}}, func(context.Context, *Task) (any, error) { return nil, nil })
	if err != nil {
		t.Fatal(err)
	}
	rt := &runningTask{attempt: 2}
	w.running[9] = rt
	return w, &TaskContext{w: w, id: 9, rt: rt}
}

// heartbeat is the next message's heartbeat reports.
func heartbeat(t *testing.T, w *Worker) []*cronoqv1.TaskReport {
	t.Helper()
	w.mu.Lock()
	w.beatDue = true
	w.mu.Unlock()
	m := w.nextMessage()
	if m.GetHeartbeat() == nil {
		t.Fatal("no heartbeat")
	}
	return m.GetHeartbeat().GetReports()
}

func answerHeartbeat(w *Worker) {
	w.answered(&cronoqv1.WorkResponse{Heartbeat: &cronoqv1.HeartbeatResponse{}})
}

func progressReport(value float64, message string) *cronoqv1.TaskReport {
	return &cronoqv1.TaskReport{TaskId: 9, Attempt: 2, Progress: &cronoqv1.TaskProgress{Value: value, Message: message}}
}

func sameReports(t *testing.T, what string, got []*cronoqv1.TaskReport, want ...*cronoqv1.TaskReport) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %v, want %v", what, got, want)
		return
	}
	for i := range got {
		if !proto.Equal(got[i], want[i]) {
			t.Errorf("%s: %v, want %v", what, got, want)
		}
	}
}

func TestReportsAreCoalescedUntilAHeartbeatIsAnswered(t *testing.T) {
	w, tc := reportingWorker(t)
	sameReports(t, "nothing reported", heartbeat(t, w))
	answerHeartbeat(w)
	_ = tc.ReportProgress(0.25, "a quarter")
	_ = tc.ReportProgress(0.5, "half")
	half := progressReport(0.5, "half")
	sameReports(t, "two progress reports", heartbeat(t, w), half)
	sameReports(t, "not yet answered", heartbeat(t, w), half)

	// The answer to the second heartbeat: the third carried the progress too, and it stays
	// pending until that one is answered.
	_ = tc.SaveCheckpoint([]byte("c1"))
	answerHeartbeat(w)
	both := progressReport(0.5, "half")
	both.Checkpoint = []byte("c1")
	sameReports(t, "a checkpoint saved", heartbeat(t, w), both)
	answerHeartbeat(w)
	answerHeartbeat(w)
	sameReports(t, "every heartbeat answered", heartbeat(t, w))

	// A newer report replaces the one a heartbeat carried: the answer keeps it.
	_ = tc.ReportProgress(0.75, "three quarters")
	sameReports(t, "a new progress", heartbeat(t, w), progressReport(0.75, "three quarters"))
	_ = tc.ReportProgress(1, "done")
	answerHeartbeat(w)
	answerHeartbeat(w)
	sameReports(t, "a newer progress", heartbeat(t, w), progressReport(1, "done"))

	// What is pending as the handler ends, sent or not, goes with the outcome.
	w.mu.Lock()
	defer w.mu.Unlock()
	if r := tc.rt.takeReport(9); !proto.Equal(r, progressReport(1, "done")) {
		t.Errorf("the report for the outcome %v", r)
	}
	if r := tc.rt.report(9); r != nil {
		t.Errorf("pending after the outcome took it: %v", r)
	}
}

func TestProgressRefusesLineSeparatorsAndBidiControls(t *testing.T) {
	w, tc := reportingWorker(t)
	for _, r := range "\u2028\u2029\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u061c" {
		err := tc.ReportProgress(1, "report"+string(r)+"fdp.exe")
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), fmt.Sprintf("control character %q", r)) {
			t.Errorf("a message with %U: %v", r, err)
		}
	}
	sameReports(t, "nothing recorded", heartbeat(t, w))
}

func TestReportsAreChecked(t *testing.T) {
	w, tc := reportingWorker(t)
	for _, v := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		if err := tc.ReportProgress(v, ""); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "not a finite number") {
			t.Errorf("progress %v: %v", v, err)
		}
	}
	if err := tc.ReportProgress(1, strings.Repeat("x", 1025)); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "1025 bytes") {
		t.Errorf("a message of 1,025 bytes: %v", err)
	}
	if err := tc.ReportProgress(1, "\xff"); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a message that is not UTF-8: %v", err)
	}
	for _, msg := range []string{"line one\nline two", "tab\t", "del\x7f", "c1\u0085", "nul\x00"} {
		if err := tc.ReportProgress(1, msg); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "control character") {
			t.Errorf("a message with a control character (%q): %v", msg, err)
		}
	}
	w.registered(&cronoqv1.RegisterWorkerResponse{}) // an older server: no max_checkpoint_bytes
	if err := tc.SaveCheckpoint(make([]byte, 256<<10+1)); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "262145 bytes") {
		t.Errorf("a checkpoint of 256 KiB + 1: %v", err)
	}
	sameReports(t, "nothing recorded", heartbeat(t, w))
	if tc.Checkpoint() != nil {
		t.Errorf("checkpoint %q after refused saves", tc.Checkpoint())
	}
	if err := tc.ReportProgress(-3, strings.Repeat("é", 511)+"\u00a0"); err != nil { // U+00A0 is not a control character
		t.Errorf("a message of 1,024 bytes: %v", err)
	}
	if err := tc.SaveCheckpoint(make([]byte, 256<<10)); err != nil {
		t.Errorf("a checkpoint of 256 KiB: %v", err)
	}

	// The server's max_checkpoint_bytes, when it gives one.
	w.registered(&cronoqv1.RegisterWorkerResponse{MaxCheckpointBytes: 8})
	if err := tc.SaveCheckpoint([]byte("123456789")); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "max_checkpoint_bytes 8") {
		t.Errorf("9 bytes, max 8: %v", err)
	}
	if err := tc.SaveCheckpoint([]byte("12345678")); err != nil || !bytes.Equal(tc.Checkpoint(), []byte("12345678")) {
		t.Errorf("8 bytes, max 8: %v", err)
	}

	// Outside a handler: nothing to report to.
	none := TaskContextFrom(context.Background())
	if none != nil || none.ReportProgress(1, "") == nil || none.SaveCheckpoint(nil) == nil || none.Checkpoint() != nil || none.Snoozes() != 0 {
		t.Errorf("the task context of a context that is not a handler's: %v", none)
	}
}

// A heartbeat carries the reports that fit its message: the others wait for the next one.
func TestHeartbeatReportsFitOneMessage(t *testing.T) {
	w, _ := reportingWorker(t)
	w.mu.Lock()
	for id := uint64(1); id <= 3; id++ {
		rt := &runningTask{attempt: 1}
		rt.saved.put(make([]byte, 40*mib), id)
		w.running[id] = rt
	}
	w.mu.Unlock()
	for beat := 1; beat <= 3; beat++ {
		if reports := heartbeat(t, w); len(reports) != 1 {
			t.Fatalf("heartbeat %d carried %d checkpoints of 40 MiB", beat, len(reports))
		}
		answerHeartbeat(w)
	}
	sameReports(t, "after three heartbeats", heartbeat(t, w))
}
