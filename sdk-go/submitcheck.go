package cronoq

import (
	"context"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// The server's bounds on a submission's fields (its defaults, for the payload).
const (
	// DefaultMaxPayloadBytes is the server's default limits.max_payload_bytes (1 MiB).
	DefaultMaxPayloadBytes = 1 << 20
	maxPoolLength          = 256 // characters
	maxKeyLength           = 256 // characters
	maxContentTypeLength   = 256 // characters
	maxGroupKeyBytes       = 256 // UTF-8 bytes
	maxAttempts            = 1000
	maxTimeoutMs           = 7 * 86_400_000
	maxDebounceMs          = 7 * 86_400_000
	maxKeyTTLMs            = 366 * 86_400_000
	// scheduleKeyPrefix starts the keys of schedules' tasks: a submission may not take one.
	scheduleKeyPrefix = "schedule:"
)

// SubmitRequest is the request Submit sends for spec (without its request id, which the
// sender sets): the same fields and payload encoding, and ctx's trace context. Where Submit
// leaves the checks to the server, SubmitRequest applies them first: pool (required), key,
// content type and group key (length, no control characters, no "schedule:" key), priority,
// max_attempts (0 to 1000), timeout (at most 7 days), run_at and start_by (years 1 to 9999,
// start_by after run_at), dependencies, run_when, the key mode with its debounce (at most 7
// days) and key TTL (at most 366 days; each needs a key), and a payload of at most
// maxPayloadBytes (0: DefaultMaxPayloadBytes). A field
// the server would refuse is an ErrInvalidArgument error naming it and its value. Resources
// and pools the server does not know are left for it to refuse.
func SubmitRequest(ctx context.Context, spec TaskSpec, maxPayloadBytes int) (*cronoqv1.SubmitTaskRequest, error) {
	req, err := spec.proto()
	if err != nil {
		return nil, err
	}
	if maxPayloadBytes <= 0 {
		maxPayloadBytes = DefaultMaxPayloadBytes
	}
	if err := checkSubmitRequest(req, maxPayloadBytes); err != nil {
		return nil, err
	}
	req.Trace = traceContext(ctx)
	return req, nil
}

// checkSubmitRequest applies the server's checks of a submission that need no server state.
func checkSubmitRequest(req *cronoqv1.SubmitTaskRequest, maxPayloadBytes int) error {
	if req.GetPool() == "" {
		return invalidArgument("pool: required")
	}
	checks := []struct {
		field, value string
		limit        int
		inBytes      bool
	}{
		{"pool", req.GetPool(), maxPoolLength, false},
		{"key", req.GetKey(), maxKeyLength, false},
		{"content_type", req.GetContentType(), maxContentTypeLength, false},
		{"group_key", req.GetGroupKey(), maxGroupKeyBytes, true},
	}
	for _, c := range checks {
		if err := checkText(c.field, c.value, c.limit, c.inBytes); err != nil {
			return err
		}
	}
	if strings.HasPrefix(req.GetKey(), scheduleKeyPrefix) {
		return invalidArgument("key: %q: keys starting with %q are reserved for schedules", req.GetKey(), scheduleKeyPrefix)
	}
	if n := len(req.GetPayload()); n > maxPayloadBytes {
		return invalidArgument("payload: %d bytes exceeds limits.max_payload_bytes %d", n, maxPayloadBytes)
	}
	if n := req.GetMaxAttempts(); n < 0 || n > maxAttempts {
		return invalidArgument("max_attempts: %d is not between 0 and %d (0 takes the pool's default)", n, maxAttempts)
	}
	if n := req.GetTimeoutMs(); n < 0 || n > maxTimeoutMs {
		return invalidArgument("timeout_ms: %d is not between 0 and %d (at most 7 days; 0 takes the pool's timeout)", n, maxTimeoutMs)
	}
	if at := req.GetRunAt(); at != nil && at.CheckValid() != nil {
		return invalidArgument("run_at: seconds %d, nanos %d is outside the Timestamp range (0001-01-01 to 9999-12-31)", at.GetSeconds(), at.GetNanos())
	}
	if _, known := cronoqv1.RunWhen_name[int32(req.GetRunWhen())]; !known {
		return invalidArgument("run_when: unknown value %d", req.GetRunWhen())
	}
	if err := checkStartBy(req); err != nil {
		return err
	}
	if err := checkKeyMode(req); err != nil {
		return err
	}
	for i, ref := range req.GetDependsOn() {
		switch r := ref.GetRef().(type) {
		case *cronoqv1.TaskRef_Id:
			if r.Id == 0 {
				return invalidArgument("depends_on[%d].id: 0 is not a task id", i)
			}
		case *cronoqv1.TaskRef_Key:
			if err := checkText(fmt.Sprintf("depends_on[%d].key", i), r.Key, maxKeyLength, false); err != nil {
				return err
			}
		default:
			return invalidArgument("depends_on[%d]: give an id or a key", i)
		}
	}
	return nil
}

// checkStartBy: a valid Timestamp, after run_at when both are given.
func checkStartBy(req *cronoqv1.SubmitTaskRequest) error {
	by := req.GetStartBy()
	if by == nil {
		return nil
	}
	if by.CheckValid() != nil {
		return invalidArgument("start_by: seconds %d, nanos %d is outside the Timestamp range (0001-01-01 to 9999-12-31)", by.GetSeconds(), by.GetNanos())
	}
	if at := req.GetRunAt(); at != nil && !by.AsTime().After(at.AsTime()) {
		return invalidArgument("start_by: %s is not after run_at %s", by.AsTime().Format(time.RFC3339Nano), at.AsTime().Format(time.RFC3339Nano))
	}
	return nil
}

// checkKeyMode: the key mode, its debounce and the key TTL, as the server bounds them. A mode
// not given is the pool's default_key_mode, and a debounce not given with KEY_MODE_DEBOUNCE
// the pool's debounce: what depends on the pool's configuration is left to the server.
func checkKeyMode(req *cronoqv1.SubmitTaskRequest) error {
	mode, debounce, maxDebounce, ttl := req.GetKeyMode(), req.GetDebounceMs(), req.GetMaxDebounceMs(), req.GetKeyTtlMs()
	ranges := []struct {
		field          string
		value, highest int64
		meaning        string
	}{
		{"debounce_ms", debounce, maxDebounceMs, "at most 7 days"},
		{"max_debounce_ms", maxDebounce, maxDebounceMs, "at most 7 days; 0: no bound"},
		{"key_ttl_ms", ttl, maxKeyTTLMs, "at most 366 days; 0: the key is held until the task is deleted"},
	}
	for _, r := range ranges {
		if r.value < 0 || r.value > r.highest {
			return invalidArgument("%s: %d is not between 0 and %d (%s)", r.field, r.value, r.highest, r.meaning)
		}
	}
	if _, known := cronoqv1.KeyMode_name[int32(mode)]; !known {
		return invalidArgument("key_mode: unknown value %d", mode)
	}
	if req.GetKey() == "" {
		switch {
		case mode > cronoqv1.KeyMode_KEY_MODE_RETURN_EXISTING:
			return invalidArgument("key: required with key_mode %s", mode)
		case ttl != 0:
			return invalidArgument("key: required with key_ttl_ms %d", ttl)
		case debounce != 0:
			return invalidArgument("key: required with debounce_ms %d", debounce)
		case maxDebounce != 0:
			return invalidArgument("key: required with max_debounce_ms %d", maxDebounce)
		}
		return nil
	}
	switch mode {
	case cronoqv1.KeyMode_KEY_MODE_UNSPECIFIED: // the pool's default_key_mode: the server's to judge
	case cronoqv1.KeyMode_KEY_MODE_DEBOUNCE:
		if maxDebounce != 0 && maxDebounce < debounce {
			return invalidArgument("max_debounce_ms: %d is less than debounce_ms %d", maxDebounce, debounce)
		}
		if at := req.GetRunAt(); at != nil {
			return invalidArgument("run_at: %s is given with KEY_MODE_DEBOUNCE, which sets when the task is due (debounce_ms after each submission)",
				at.AsTime().Format(time.RFC3339Nano))
		}
	default:
		if debounce != 0 {
			return invalidArgument("debounce_ms: %d applies only with KEY_MODE_DEBOUNCE, not %s", debounce, mode)
		}
		if maxDebounce != 0 {
			return invalidArgument("max_debounce_ms: %d applies only with KEY_MODE_DEBOUNCE, not %s", maxDebounce, mode)
		}
	}
	return nil
}

// checkText: a caller-chosen name, valid UTF-8, at most limit characters (or UTF-8 bytes)
// and free of control characters, as the server requires.
func checkText(field, value string, limit int, inBytes bool) error {
	if !utf8.ValidString(value) {
		return invalidArgument("%s: %q is not valid UTF-8", field, value)
	}
	size, unit := utf8.RuneCountInString(value), "characters"
	if inBytes {
		size, unit = len(value), "bytes"
	}
	if size > limit {
		return invalidArgument("%s: %d %s, more than %d: %q", field, size, unit, limit, shortened(value))
	}
	if i := strings.IndexFunc(value, isControl); i >= 0 {
		r, _ := utf8.DecodeRuneInString(value[i:])
		return invalidArgument("%s: control character %q in %q", field, r, shortened(value))
	}
	return nil
}

// shortened: the first 64 characters of a refused value, enough to recognise it in a message.
func shortened(value string) string {
	if utf8.RuneCountInString(value) <= 64 {
		return value
	}
	return string([]rune(value)[:64]) + "…"
}

func invalidArgument(format string, args ...any) *Error {
	return newError(codes.InvalidArgument, kindCode, format, args...)
}
