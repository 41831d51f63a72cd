package cronoq

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
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
