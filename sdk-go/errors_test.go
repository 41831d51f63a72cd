package cronoq

import (
	"errors"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

func TestEveryCodeMatchesItsSentinel(t *testing.T) {
	sentinels := map[codes.Code]error{
		codes.Canceled: ErrCancelled, codes.Unknown: ErrUnknown, codes.InvalidArgument: ErrInvalidArgument,
		codes.DeadlineExceeded: ErrDeadlineExceeded, codes.NotFound: ErrNotFound, codes.AlreadyExists: ErrAlreadyExists,
		codes.PermissionDenied: ErrPermissionDenied, codes.ResourceExhausted: ErrResourceExhausted,
		codes.FailedPrecondition: ErrFailedPrecondition, codes.Aborted: ErrAborted, codes.OutOfRange: ErrOutOfRange,
		codes.Unimplemented: ErrUnimplemented, codes.Internal: ErrInternal, codes.Unavailable: ErrUnavailable,
		codes.DataLoss: ErrDataLoss, codes.Unauthenticated: ErrUnauthenticated,
	}
	for code, sentinel := range sentinels {
		err := fromGRPC(status.Error(code, "refused"), nil)
		if !errors.Is(err, sentinel) {
			t.Errorf("%s: errors.Is(err, its sentinel) is false", CodeName(code))
		}
		for other, s := range sentinels {
			if other != code && errors.Is(err, s) {
				t.Errorf("%s matches the sentinel of %s", CodeName(code), CodeName(other))
			}
		}
		if got := status.Code(err); got != code {
			t.Errorf("status.Code(%s error) = %v", CodeName(code), got)
		}
	}
	if CodeName(codes.Canceled) != "CANCELLED" || CodeName(codes.FailedPrecondition) != "FAILED_PRECONDITION" {
		t.Errorf("code names are not the canonical gRPC names")
	}
}

func TestStructuredDetailsAreRead(t *testing.T) {
	st, err := status.New(codes.FailedPrecondition, "pool llm is served by shard gpu").WithDetails(
		&errdetails.ErrorInfo{Reason: "WRONG_SHARD", Metadata: map[string]string{
			"shard": "gpu", "shard_endpoint": "https://gpu.example:7070", "leader": "https://gpu-1.example:7070"}},
		&errdetails.RetryInfo{RetryDelay: durationpb.New(1500 * time.Millisecond)},
	)
	if err != nil {
		t.Fatal(err)
	}
	var e *Error
	if !errors.As(fromGRPC(st.Err(), nil), &e) {
		t.Fatal("not an *Error")
	}
	if e.Reason != "WRONG_SHARD" || e.Shard != "gpu" || e.ShardEndpoint != "https://gpu.example:7070" ||
		e.Leader != "https://gpu-1.example:7070" || e.RetryDelay != 1500*time.Millisecond {
		t.Errorf("details not read: %+v", e)
	}
	if e.Message != "pool llm is served by shard gpu" || e.Error() != "FAILED_PRECONDITION: pool llm is served by shard gpu" {
		t.Errorf("message: %q / %q", e.Message, e.Error())
	}

	// The cronoq-* trailers win over the structured error's metadata.
	trailer := metadata.Pairs("cronoq-shard-endpoint", "http://127.0.0.1:7071", "cronoq-leader", "http://127.0.0.1:7072")
	if !errors.As(fromGRPC(st.Err(), trailer), &e) {
		t.Fatal("not an *Error")
	}
	if e.ShardEndpoint != "http://127.0.0.1:7071" || e.Leader != "http://127.0.0.1:7072" || e.Shard != "gpu" {
		t.Errorf("trailers not preferred: %+v", e)
	}
}

func TestKindsMatchTheirSentinels(t *testing.T) {
	tooMany := newError(codes.FailedPrecondition, kindTooManyRedirects, "redirected more than 3 times")
	if !errors.Is(tooMany, ErrTooManyRedirects) || !errors.Is(tooMany, ErrFailedPrecondition) || errors.Is(tooMany, ErrRedirectRefused) {
		t.Error("too many redirects: wrong matches")
	}
	tlsErr := newError(codes.Unavailable, kindTLS, "https://a:1: TLS handshake failed: unknown CA")
	if !errors.Is(tlsErr, ErrTLS) || errors.Is(tlsErr, ErrUnavailable) {
		t.Error("a TLS error must match ErrTLS and not ErrUnavailable (it is never retried)")
	}
	if retryable(tlsErr) || !retryable(fromGRPC(status.Error(codes.Unavailable, "x"), nil)) ||
		!retryable(fromGRPC(status.Error(codes.Canceled, "x"), nil)) || retryable(fromGRPC(status.Error(codes.NotFound, "x"), nil)) {
		t.Error("retryable: only UNAVAILABLE and CANCELLED")
	}
}

func TestNonStatusErrorsPassThrough(t *testing.T) {
	plain := errors.New("boom")
	if fromGRPC(plain, nil) != plain || fromGRPC(nil, nil) != nil {
		t.Error("a non-gRPC error must pass through unchanged")
	}
}
