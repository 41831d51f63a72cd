package cronoq

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

func TestSubmitRequestRefusesWhatTheServerRefuses(t *testing.T) {
	long := strings.Repeat("é", 257)
	cases := []struct {
		name string
		spec TaskSpec
		max  int
		want string
	}{
		{"no pool", TaskSpec{}, 0, "pool: required"},
		{"long pool", TaskSpec{Pool: long}, 0, "pool: 257 characters, more than 256"},
		{"pool control", TaskSpec{Pool: "a\nb"}, 0, `pool: control character '\n' in "a\nb"`},
		{"long key", TaskSpec{Pool: "p", Key: long}, 0, "key: 257 characters, more than 256"},
		{"key control", TaskSpec{Pool: "p", Key: "k\u0085"}, 0, "key: control character"},
		{"schedule key", TaskSpec{Pool: "p", Key: "schedule:p:n:1"}, 0, `key: "schedule:p:n:1": keys starting with "schedule:" are reserved for schedules`},
		{"group key bytes", TaskSpec{Pool: "p", GroupKey: strings.Repeat("é", 129)}, 0, "group_key: 258 bytes, more than 256"},
		{"group key bidi", TaskSpec{Pool: "p", GroupKey: "g\u2066"}, 0, "group_key: control character"},
		{"line separator", TaskSpec{Pool: "p", Key: "a\u2028b"}, 0, "key: control character"},
		{"invalid UTF-8", TaskSpec{Pool: "p\xff"}, 0, "pool: \"p\\xff\" is not valid UTF-8"},
		{"payload", TaskSpec{Pool: "p", Payload: make([]byte, DefaultMaxPayloadBytes+1)}, 0, "payload: 1048577 bytes exceeds limits.max_payload_bytes 1048576"},
		{"payload over a limit", TaskSpec{Pool: "p", Payload: []byte("xx")}, 1, "payload: 2 bytes exceeds limits.max_payload_bytes 1"},
		{"max attempts", TaskSpec{Pool: "p", MaxAttempts: 1001}, 0, "max_attempts: 1001 is not between 0 and 1000"},
		{"negative max attempts", TaskSpec{Pool: "p", MaxAttempts: -1}, 0, "max_attempts: -1 is not between 0 and 1000"},
		{"timeout", TaskSpec{Pool: "p", Timeout: 7*24*time.Hour + time.Millisecond}, 0, "timeout_ms: 604800001 is not between 0 and 604800000"},
		{"run at", TaskSpec{Pool: "p", RunAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}, 0, "run_at: seconds 253402300800, nanos 0 is outside the Timestamp range"},
		{"run when", TaskSpec{Pool: "p", RunWhen: 7}, 0, "run_when: unknown value 7"},
		{"dependency id", TaskSpec{Pool: "p", DependsOn: []TaskRef{ByKey("a"), ByID(0)}}, 0, "depends_on[1].id: 0 is not a task id"},
		{"dependency key", TaskSpec{Pool: "p", DependsOn: []TaskRef{ByKey("a\x7f")}}, 0, "depends_on[0].key: control character"},
		{"dependency unset", TaskSpec{Pool: "p", DependsOn: []TaskRef{{}}}, 0, "task: give cronoq.ByID(id) or cronoq.ByKey(key)"},
		{"key mode", TaskSpec{Pool: "p", Key: "k", KeyMode: 9}, 0, "key_mode: unknown value 9"},
		{"replace without key", TaskSpec{Pool: "p", KeyMode: KeyModeReplacePending}, 0, "key: required with key_mode KEY_MODE_REPLACE_PENDING"},
		{"debounce without key", TaskSpec{Pool: "p", KeyMode: KeyModeDebounce, Debounce: time.Second}, 0, "key: required with key_mode KEY_MODE_DEBOUNCE"},
		{"key ttl without key", TaskSpec{Pool: "p", KeyTTL: time.Hour}, 0, "key: required with key_ttl_ms 3600000"},
		{"debounce ms without key", TaskSpec{Pool: "p", Debounce: time.Second}, 0, "key: required with debounce_ms 1000"},
		{"max debounce without key", TaskSpec{Pool: "p", MaxDebounce: time.Second}, 0, "key: required with max_debounce_ms 1000"},
		{"debounce too long", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: 7*24*time.Hour + time.Millisecond}, 0,
			"debounce_ms: 604800001 is not between 0 and 604800000 (at most 7 days)"},
		{"debounce negative", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: -time.Microsecond}, 0, "debounce_ms: -1 is not between 0 and 604800000"},
		{"debounce negative, pool's mode", TaskSpec{Pool: "p", Key: "k", Debounce: -time.Second}, 0, "debounce_ms: -1000 is not between 0 and 604800000"},
		{"debounce with replace", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeReplacePending, Debounce: time.Second}, 0,
			"debounce_ms: 1000 applies only with KEY_MODE_DEBOUNCE, not KEY_MODE_REPLACE_PENDING"},
		{"debounce with return", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeReturnExisting, Debounce: time.Second}, 0,
			"debounce_ms: 1000 applies only with KEY_MODE_DEBOUNCE, not KEY_MODE_RETURN_EXISTING"},
		{"max debounce with replace", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeReplacePending, MaxDebounce: time.Minute}, 0,
			"max_debounce_ms: 60000 applies only with KEY_MODE_DEBOUNCE, not KEY_MODE_REPLACE_PENDING"},
		{"debounce with run at", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Second, RunAt: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}, 0,
			"run_at: 2030-01-02T03:04:05Z is given with KEY_MODE_DEBOUNCE"},
		{"debounce with delay", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Second, Delay: time.Minute}, 0, "is given with KEY_MODE_DEBOUNCE"},
		{"max debounce under debounce", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Second, MaxDebounce: 999 * time.Millisecond}, 0,
			"max_debounce_ms: 999 is less than debounce_ms 1000"},
		{"max debounce too long", TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Second, MaxDebounce: 8 * 24 * time.Hour}, 0,
			"max_debounce_ms: 691200000 is not between 0 and 604800000 (at most 7 days; 0: no bound)"},
		{"max debounce negative", TaskSpec{Pool: "p", Key: "k", MaxDebounce: -time.Second}, 0, "max_debounce_ms: -1000 is not between 0 and 604800000"},
		{"key ttl too long", TaskSpec{Pool: "p", Key: "k", KeyTTL: 367 * 24 * time.Hour}, 0, "key_ttl_ms: 31708800000 is not between 0 and 31622400000 (at most 366 days"},
		{"key ttl negative", TaskSpec{Pool: "p", Key: "k", KeyTTL: -time.Hour}, 0, "key_ttl_ms: -3600000 is not between 0 and 31622400000"},
		{"start by before run at", TaskSpec{Pool: "p", RunAt: time.Date(2030, 1, 1, 0, 0, 1, 0, time.UTC), StartBy: time.Date(2030, 1, 1, 0, 0, 0, 500, time.UTC)}, 0,
			"start_by: 2030-01-01T00:00:00.0000005Z is not after run_at 2030-01-01T00:00:01Z"},
		{"start by at run at", TaskSpec{Pool: "p", RunAt: time.Date(2030, 1, 1, 0, 0, 1, 0, time.UTC), StartBy: time.Date(2030, 1, 1, 0, 0, 1, 0, time.UTC)}, 0,
			"start_by: 2030-01-01T00:00:01Z is not after run_at 2030-01-01T00:00:01Z"},
		{"start by before delay", TaskSpec{Pool: "p", Delay: time.Hour, StartBy: time.Now().Add(time.Minute)}, 0, "is not after run_at"},
		{"start by range", TaskSpec{Pool: "p", StartBy: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}, 0, "start_by: seconds 253402300800, nanos 0 is outside the Timestamp range"},
	}
	for _, c := range cases {
		req, err := SubmitRequest(context.Background(), c.spec, c.max)
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: request %v, error %v; want INVALID_ARGUMENT with %q", c.name, req, err, c.want)
		}
	}
}

func TestSubmitRequestAdmitsTheLimits(t *testing.T) {
	spec := TaskSpec{
		Pool: strings.Repeat("é", 256), Key: strings.Repeat("k", 256), GroupKey: strings.Repeat("é", 128),
		Payload: make([]byte, DefaultMaxPayloadBytes), MaxAttempts: 1000, Timeout: 7 * 24 * time.Hour,
		Priority: -1 << 31, RunAt: time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC),
		DependsOn: []TaskRef{ByID(1), ByKey("schedule:p:n:1")}, RunWhen: RunWhenDependenciesEnded,
		KeyMode: KeyModeReplacePending, KeyTTL: 366 * 24 * time.Hour, StartBy: time.Date(9999, 12, 31, 23, 59, 59, 999_999_999, time.UTC),
	}
	req, err := SubmitRequest(context.Background(), spec, 0)
	if err != nil {
		t.Fatal(err)
	}
	want, err := spec.proto()
	if err != nil || !proto.Equal(req, want) {
		t.Fatalf("request %v, want Submit's %v (%v)", req, want, err)
	}
}

func TestSubmitRequestAdmitsTheKeyModesAtTheirLimits(t *testing.T) {
	runAt := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	specs := []TaskSpec{
		{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Millisecond},
		{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: 7 * 24 * time.Hour, MaxDebounce: 7 * 24 * time.Hour},
		{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Second, MaxDebounce: time.Second, StartBy: runAt},
		{Pool: "p", Key: "k", KeyMode: KeyModeReplacePending, RunAt: runAt, StartBy: runAt.Add(time.Nanosecond)},
		{Pool: "p", Key: "k", KeyMode: KeyModeReturnExisting, KeyTTL: 366 * 24 * time.Hour},
		{Pool: "p", KeyMode: KeyModeReturnExisting}, // what a submission without a key does anyway
		// The pool's default_key_mode may be debounce, and its debounce the default debounce_ms.
		{Pool: "p", Key: "k", Debounce: time.Second, MaxDebounce: time.Minute},
		{Pool: "p", Key: "k", KeyMode: KeyModeDebounce},
		{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, MaxDebounce: time.Minute},
		{Pool: "p", StartBy: runAt},
	}
	for i, spec := range specs {
		if _, err := SubmitRequest(context.Background(), spec, 0); err != nil {
			t.Errorf("specs[%d] %+v: %v", i, spec, err)
		}
	}
}

func TestTaskSpecSendsTheKeyModeAndTheStartDeadline(t *testing.T) {
	startBy := time.Date(2030, 1, 1, 0, 0, 0, 123_000_000, time.UTC)
	spec := TaskSpec{
		Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: 1500 * time.Millisecond, MaxDebounce: time.Minute,
		KeyTTL: 24 * time.Hour, StartBy: startBy,
	}
	req, err := SubmitRequest(context.Background(), spec, 0)
	if err != nil {
		t.Fatal(err)
	}
	want := &cronoqv1.SubmitTaskRequest{
		Pool: "p", Key: "k", KeyMode: cronoqv1.KeyMode_KEY_MODE_DEBOUNCE, DebounceMs: 1500, MaxDebounceMs: 60_000,
		KeyTtlMs: 86_400_000, StartBy: timestamppb.New(startBy),
	}
	if !proto.Equal(req, want) {
		t.Errorf("request %v, want %v", req, want)
	}
	// A duration shorter than a millisecond is not "none"; none given sends none.
	req, err = (TaskSpec{Pool: "p", Key: "k", KeyMode: KeyModeDebounce, Debounce: time.Microsecond, KeyTTL: time.Nanosecond}).proto()
	if err != nil || req.GetDebounceMs() != 1 || req.GetKeyTtlMs() != 1 || req.GetMaxDebounceMs() != 0 || req.GetStartBy() != nil {
		t.Errorf("request %v, %v", req, err)
	}
	req, err = (TaskSpec{Pool: "p"}).proto()
	if err != nil || req.GetKeyMode() != cronoqv1.KeyMode_KEY_MODE_UNSPECIFIED || req.GetStartBy() != nil || req.GetKeyTtlMs() != 0 {
		t.Errorf("request %v, %v", req, err)
	}
}

func TestExpiredIsTerminal(t *testing.T) {
	for state, terminal := range map[TaskState]bool{
		TaskStatePending: false, TaskStateBlocked: false, TaskStateRunning: false,
		TaskStateSucceeded: true, TaskStateFailed: true, TaskStateCancelled: true, TaskStateExpired: true,
	} {
		if Terminal(state) != terminal {
			t.Errorf("Terminal(%v) = %v", state, !terminal)
		}
	}
	if TaskStateExpired.String() != "TASK_STATE_EXPIRED" {
		t.Errorf("%v", TaskStateExpired)
	}
}
