package cronoq

import (
	"bytes"
	"context"
	"errors"
	"math"
	"strings"
	"unicode/utf8"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// maxProgressMessage is the most bytes of a progress message.
const maxProgressMessage = 1024

// TaskContext is what a running handler reports besides its outcome: its progress, which
// the task shows (Task.progress), and its checkpoint, which the task's next attempt (or its
// next run after a snooze) gets. TaskContextFrom gets it from the handler's ctx; its methods
// are safe from any goroutine.
//
// Reports are coalesced: the worker's next heartbeat carries the last progress and the last
// checkpoint of each running task, and what no answered heartbeat carried when the handler
// returns goes with its outcome.
type TaskContext struct {
	w            *Worker
	id           uint64
	rt           *runningTask
	snoozes      int32
	dependencies []DependencyResult
	span         trace.SpanContext // the handler's: the trace its spawned tasks carry
}

type taskContextKey struct{}

// TaskContextFrom is the task context of the handler whose ctx this is (or a context derived
// from it); nil for any other ctx, whose methods report nothing and say so.
func TaskContextFrom(ctx context.Context) *TaskContext {
	t, _ := ctx.Value(taskContextKey{}).(*TaskContext)
	return t
}

var errNotAHandler = errors.New("cronoq: not a handler's task context: nothing is reported")

// Snoozes is how many times the task was snoozed before this attempt (Task.snoozes).
func (t *TaskContext) Snoozes() int32 {
	if t == nil {
		return 0
	}
	return t.snoozes
}

// Checkpoint is the task's checkpoint: as leased (the last one an earlier attempt saved), or
// the last one this handler saved; nil when it has none.
func (t *TaskContext) Checkpoint() []byte {
	if t == nil {
		return nil
	}
	t.w.mu.Lock()
	defer t.w.mu.Unlock()
	return bytes.Clone(t.rt.checkpoint)
}

// ReportProgress reports the handler's progress: value a finite number (commonly a fraction
// from 0 to 1), message at most 1,024 bytes of UTF-8 without control characters, line
// separators (U+2028, U+2029) or bidi controls (the server refuses those). Anything else is
// an ErrInvalidArgument error, and nothing is reported.
func (t *TaskContext) ReportProgress(value float64, message string) error {
	switch {
	case math.IsNaN(value) || math.IsInf(value, 0):
		return newError(codes.InvalidArgument, kindCode, "progress: %v is not a finite number", value)
	case len(message) > maxProgressMessage:
		return newError(codes.InvalidArgument, kindCode, "progress: a message of %d bytes, more than %d", len(message), maxProgressMessage)
	case !utf8.ValidString(message):
		return newError(codes.InvalidArgument, kindCode, "progress: the message is not valid UTF-8")
	}
	if i := strings.IndexFunc(message, isControl); i >= 0 {
		r, _ := utf8.DecodeRuneInString(message[i:])
		return newError(codes.InvalidArgument, kindCode, "progress: control character %q in the message", r)
	}
	return t.record(func(rt *runningTask, version uint64) error {
		rt.progress.put(&cronoqv1.TaskProgress{Value: value, Message: message}, version)
		return nil
	})
}

// SaveCheckpoint saves data as the task's checkpoint (empty data clears it): an attempt that
// does not succeed leaves it to the next one. More than the server's max_checkpoint_bytes
// (256 KiB by default) is an ErrInvalidArgument error, and nothing is saved.
func (t *TaskContext) SaveCheckpoint(data []byte) error {
	return t.record(func(rt *runningTask, version uint64) error {
		if len(data) > t.w.maxCheckpoint {
			return newError(codes.InvalidArgument, kindCode, "checkpoint: %d bytes, more than max_checkpoint_bytes %d", len(data), t.w.maxCheckpoint)
		}
		saved := append([]byte{}, data...) // never nil: an empty one is sent, and clears the task's
		rt.saved.put(saved, version)
		rt.checkpoint = nil
		if len(saved) > 0 {
			rt.checkpoint = saved
		}
		return nil
	})
}

// isControl: a control character (C0, DEL, C1), a line separator or a bidi control, which the
// server refuses in a text a caller chooses (it could forge log lines, or reorder what a reader sees).
func isControl(r rune) bool {
	switch {
	case r < 32 || (r >= 127 && r < 160):
		return true
	case r == '\u061c' || r == '\u200e' || r == '\u200f' || r == '\u2028' || r == '\u2029':
		return true
	}
	return (r >= '\u202a' && r <= '\u202e') || (r >= '\u2066' && r <= '\u2069')
}

// record applies a report to the task's state, under the worker's lock, with the report's
// version; once the handler has returned, nothing more is reported (ErrFailedPrecondition).
func (t *TaskContext) record(report func(rt *runningTask, version uint64) error) error {
	if t == nil {
		return errNotAHandler
	}
	t.w.mu.Lock()
	defer t.w.mu.Unlock()
	if t.w.running[t.id] != t.rt {
		return newError(codes.FailedPrecondition, kindCode, "task %d: its handler has returned: nothing more is reported", t.id)
	}
	t.w.reports++
	return report(t.rt, t.w.reports)
}

// pending is a handler's last report of one kind that the server has not acknowledged: a
// heartbeat that carries it marks it with the report's version and its own number on the
// stream, and the answer to that heartbeat drops it unless a newer report replaced it
// meanwhile. The n-th answer of a stream is taken for its n-th heartbeat's: each answer
// covers one heartbeat or more, so by then the n-th or a later one has been answered, and
// each carries every pending report that fits its message.
type pending[T any] struct {
	value   T
	set     bool
	version uint64 // the report's
	sent    uint64 // the version a heartbeat carried last (0: none on this stream)
	beat    uint64 // that heartbeat's number on the stream
}

func (p *pending[T]) put(value T, version uint64) {
	p.value, p.set, p.version = value, true, version
}

// carried: heartbeat number beat carries it.
func (p *pending[T]) carried(beat uint64) {
	if p.set {
		p.sent, p.beat = p.version, beat
	}
}

// unsent: a new stream, whose heartbeats carry it again.
func (p *pending[T]) unsent() { p.sent, p.beat = 0, 0 }

// acknowledged: the stream's heartbeats up to number beats are answered.
func (p *pending[T]) acknowledged(beats uint64) {
	if p.set && p.sent == p.version && p.beat <= beats {
		*p = pending[T]{}
	}
}

// report is the TaskReport of what is pending, nil when nothing is.
func (rt *runningTask) report(id uint64) *cronoqv1.TaskReport {
	if !rt.progress.set && !rt.saved.set {
		return nil
	}
	r := &cronoqv1.TaskReport{TaskId: id, Attempt: rt.attempt}
	if rt.progress.set {
		r.Progress = rt.progress.value
	}
	if rt.saved.set {
		r.Checkpoint = rt.saved.value
	}
	return r
}

// takeReport is what is pending as the handler returns, for its outcome (nil: nothing).
func (rt *runningTask) takeReport(id uint64) *cronoqv1.TaskReport {
	r := rt.report(id)
	rt.progress, rt.saved = pending[*cronoqv1.TaskProgress]{}, pending[[]byte]{}
	return r
}

// beatReports adds the running handlers' pending reports to a heartbeat, each marked as
// carried by it, while the message (size: its bytes so far) stays within maxRequestBytes;
// the others wait for the next heartbeat (one always goes in a message without outcomes).
// Call with mu held.
func (w *Worker) beatReports(m *cronoqv1.WorkRequest, size int) {
	w.beatsSent++
	for id, rt := range w.running {
		r := rt.report(id)
		if r == nil || rt.lost {
			continue
		}
		n := proto.Size(r) + framing
		if size+n > maxRequestBytes && (len(m.Outcomes) > 0 || len(m.Heartbeat.Reports) > 0) {
			continue
		}
		size += n
		m.Heartbeat.Reports = append(m.Heartbeat.Reports, r)
		rt.progress.carried(w.beatsSent)
		rt.saved.carried(w.beatsSent)
	}
}
