package cronoq

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Error is every error the SDK returns for a refused or failed call. Match it with
// errors.Is against the sentinel of its code (ErrNotFound, ErrUnavailable, ...) or of its
// kind (ErrTooManyRedirects, ErrRedirectRefused, ErrTLS), and read its details with
// errors.As:
//
//	var e *cronoq.Error
//	if errors.As(err, &e) && e.ShardEndpoint != "" { ... }
type Error struct {
	// Code is the gRPC status code.
	Code codes.Code
	// Message is the server's message (or the SDK's, for its own errors).
	Message string
	// Reason is why, as an UPPER_SNAKE_CASE constant (NOT_LEADER, WRONG_SHARD, ...), from the
	// server's structured error (google.rpc.ErrorInfo).
	Reason string
	// Shard and ShardEndpoint name the shard that serves the request, when the server sent
	// the caller elsewhere; Leader is the address of the leader a standby names.
	Shard, ShardEndpoint, Leader string
	// RetryDelay is what the server suggests waiting before a retry (google.rpc.RetryInfo),
	// 0 when it does not.
	RetryDelay time.Duration
	// Metadata holds the call's text trailers (cronoq-shard, cronoq-leader, ...).
	Metadata map[string]string

	kind kind
}

type kind int

const (
	kindCode kind = iota
	kindTooManyRedirects
	kindRedirectRefused
	kindTLS
)

// Error is the code's name and the server's message (a TLS error: the message alone).
func (e *Error) Error() string {
	if e.kind == kindTLS {
		return e.Message
	}
	return CodeName(e.Code) + ": " + e.Message
}

// Is matches the sentinels: a code's (ErrNotFound, ...) and a kind's (ErrTooManyRedirects,
// ErrRedirectRefused, ErrTLS). A TLS error has code UNAVAILABLE but is not ErrUnavailable:
// no retry can fix it.
func (e *Error) Is(target error) bool {
	s, ok := target.(*sentinel)
	if !ok {
		return false
	}
	if s.kind != kindCode {
		return e.kind == s.kind
	}
	return e.Code == s.code && e.kind != kindTLS
}

// GRPCStatus lets status.FromError and status.Code read the error's code and message.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

type sentinel struct {
	code codes.Code
	kind kind
	name string
}

func (s *sentinel) Error() string { return "cronoq: " + s.name }

func codeSentinel(c codes.Code) error { return &sentinel{code: c, name: CodeName(c)} }

// One sentinel per gRPC code, for errors.Is.
var (
	ErrCancelled          = codeSentinel(codes.Canceled)
	ErrUnknown            = codeSentinel(codes.Unknown)
	ErrInvalidArgument    = codeSentinel(codes.InvalidArgument)
	ErrDeadlineExceeded   = codeSentinel(codes.DeadlineExceeded)
	ErrNotFound           = codeSentinel(codes.NotFound)
	ErrAlreadyExists      = codeSentinel(codes.AlreadyExists)
	ErrPermissionDenied   = codeSentinel(codes.PermissionDenied)
	ErrResourceExhausted  = codeSentinel(codes.ResourceExhausted)
	ErrFailedPrecondition = codeSentinel(codes.FailedPrecondition)
	ErrAborted            = codeSentinel(codes.Aborted)
	ErrOutOfRange         = codeSentinel(codes.OutOfRange)
	ErrUnimplemented      = codeSentinel(codes.Unimplemented)
	ErrInternal           = codeSentinel(codes.Internal)
	ErrUnavailable        = codeSentinel(codes.Unavailable)
	ErrDataLoss           = codeSentinel(codes.DataLoss)
	ErrUnauthenticated    = codeSentinel(codes.Unauthenticated)
)

// The SDK's errors that are more than their code.
var (
	// ErrTooManyRedirects: a worker was sent to another shard more than 3 times in a row
	// (code FAILED_PRECONDITION; the message names the chain).
	ErrTooManyRedirects error = &sentinel{kind: kindTooManyRedirects, name: "too many redirects"}
	// ErrRedirectRefused: a redirect the connection rules forbid, https:// to http://, or a
	// token over plain http:// to a non-loopback host, or one whose target is not an
	// endpoint (see ParseEndpoint; the message names the target). Code FAILED_PRECONDITION,
	// the shard redirect's (a leader hint refused is logged, and the retries go on).
	ErrRedirectRefused error = &sentinel{kind: kindRedirectRefused, name: "redirect refused"}
	// ErrTLS: a TLS handshake failed (code UNAVAILABLE, never retried); the message is
	// "https://host:port: TLS handshake failed: <reason>".
	ErrTLS error = &sentinel{kind: kindTLS, name: "TLS handshake failed"}
)

var codeNames = map[codes.Code]string{
	codes.OK:                 "OK",
	codes.Canceled:           "CANCELLED",
	codes.Unknown:            "UNKNOWN",
	codes.InvalidArgument:    "INVALID_ARGUMENT",
	codes.DeadlineExceeded:   "DEADLINE_EXCEEDED",
	codes.NotFound:           "NOT_FOUND",
	codes.AlreadyExists:      "ALREADY_EXISTS",
	codes.PermissionDenied:   "PERMISSION_DENIED",
	codes.ResourceExhausted:  "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION",
	codes.Aborted:            "ABORTED",
	codes.OutOfRange:         "OUT_OF_RANGE",
	codes.Unimplemented:      "UNIMPLEMENTED",
	codes.Internal:           "INTERNAL",
	codes.Unavailable:        "UNAVAILABLE",
	codes.DataLoss:           "DATA_LOSS",
	codes.Unauthenticated:    "UNAUTHENTICATED",
}

// CodeName is a code's canonical gRPC name, as the server and the other SDKs spell it
// (CANCELLED, FAILED_PRECONDITION, ...).
func CodeName(c codes.Code) string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return fmt.Sprintf("CODE(%d)", uint32(c))
}

// fromGRPC is the SDK error for an error of a gRPC call (with its trailers, when known).
// Errors that are already *Error, and context errors, pass through unchanged.
func fromGRPC(err error, trailer metadata.MD) error {
	if err == nil {
		return nil
	}
	var e *Error
	if errors.As(err, &e) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	e = &Error{Code: st.Code(), Message: st.Message(), Metadata: map[string]string{}}
	if e.Message == "" {
		e.Message = CodeName(e.Code)
	}
	for key, values := range trailer {
		if !strings.HasSuffix(key, "-bin") && len(values) > 0 {
			e.Metadata[key] = values[0]
		}
	}
	var info map[string]string
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			e.Reason = d.GetReason()
			info = d.GetMetadata()
		case *errdetails.RetryInfo:
			e.RetryDelay = d.GetRetryDelay().AsDuration()
		}
	}
	// The cronoq-* trailers win; the structured error's metadata fills what they lack.
	pick := func(trailerKey, infoKey string) string {
		if v := e.Metadata[trailerKey]; v != "" {
			return v
		}
		return info[infoKey]
	}
	e.Shard = pick("cronoq-shard", "shard")
	e.ShardEndpoint = pick("cronoq-shard-endpoint", "shard_endpoint")
	e.Leader = pick("cronoq-leader", "leader")
	return e
}

func newError(code codes.Code, k kind, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...), kind: k}
}

// retryable: failures a transport retry may get past. CANCELLED that the caller did not ask
// for comes from a server that closed while the call waited (submissions carry a
// request_id, so a retry never creates a second task).
func retryable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrCancelled)
}

func asError(err error, target **Error) bool { return errors.As(err, target) }
