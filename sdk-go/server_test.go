package cronoq

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"log/slog"
	"math/big"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
)

// An in-process gRPC server on a loopback port, for the unit tests of the SDK's logic.
// (The conformance suite checks the SDK against the scripted server and real servers.)
func serve(t *testing.T, register func(*grpc.Server), opts ...grpc.ServerOption) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(opts...)
	register(srv)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

type taskServer struct {
	cronoqv1.UnimplementedTaskServiceServer
	mu      sync.Mutex
	calls   int
	tokens  []string
	answers []func(req *cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error)
}

func (s *taskServer) GetTask(ctx context.Context, req *cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	md, _ := metadata.FromIncomingContext(ctx)
	s.tokens = append(s.tokens, md.Get("authorization")...)
	answer := s.answers[min(s.calls, len(s.answers)-1)]
	s.calls++
	return answer(req)
}

func fastRetry() RetryConfig {
	return RetryConfig{InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, MaxElapsed: time.Second}
}

func TestClientRetriesUnavailableAndKeepsTopBitIDs(t *testing.T) {
	const id = uint64(1)<<63 | 1
	srv := &taskServer{answers: []func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error){
		func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
			return nil, status.Error(codes.Unavailable, "starting")
		},
		func(req *cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
			return &cronoqv1.GetTaskResponse{Task: &cronoqv1.Task{Id: req.GetTask().GetId(), State: TaskStateRunning}}, nil
		},
	}}
	addr := serve(t, func(s *grpc.Server) { cronoqv1.RegisterTaskServiceServer(s, srv) })
	client, err := NewClient(Options{Endpoint: "http://" + addr, Token: "tok", Retry: fastRetry(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	task, err := client.Get(context.Background(), ByID(id))
	if err != nil {
		t.Fatal(err)
	}
	if task.GetId() != id || srv.calls != 2 {
		t.Errorf("id %d after %d calls; want %d after 2", task.GetId(), srv.calls, id)
	}
	for _, tok := range srv.tokens {
		if tok != "Bearer tok" {
			t.Errorf("authorization %q", tok)
		}
	}
}

func TestClientGivesUpAfterMaxElapsed(t *testing.T) {
	srv := &taskServer{answers: []func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error){
		func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
			return nil, status.Error(codes.Unavailable, "scripted outage")
		},
	}}
	addr := serve(t, func(s *grpc.Server) { cronoqv1.RegisterTaskServiceServer(s, srv) })
	retry := fastRetry()
	retry.MaxElapsed = 100 * time.Millisecond
	client, _ := NewClient(Options{Endpoint: addr, Retry: retry, Logger: quietLogger()})
	defer client.Close()
	started := time.Now()
	_, err := client.Get(context.Background(), ByKey("k"))
	if !errors.Is(err, ErrUnavailable) || time.Since(started) > 2*time.Second || srv.calls < 2 {
		t.Errorf("err %v after %v and %d calls", err, time.Since(started), srv.calls)
	}
	// A non-retryable code is returned at once.
	srv.answers[0] = func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
		return nil, status.Error(codes.NotFound, "no task k")
	}
	srv.calls = 0
	if _, err := client.Get(context.Background(), ByKey("k")); !errors.Is(err, ErrNotFound) || srv.calls != 1 {
		t.Errorf("NOT_FOUND: %v after %d calls", err, srv.calls)
	}
}

func TestClientFollowsTheLeaderHint(t *testing.T) {
	leader := &taskServer{answers: []func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error){
		func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
			return &cronoqv1.GetTaskResponse{Task: &cronoqv1.Task{Id: 12}}, nil
		},
	}}
	leaderAddr := serve(t, func(s *grpc.Server) { cronoqv1.RegisterTaskServiceServer(s, leader) })
	standby := &taskServer{answers: []func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error){
		func(*cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
			return nil, status.Error(codes.Unavailable, "a standby")
		},
	}}
	standbyAddr := serve(t, func(s *grpc.Server) {
		cronoqv1.RegisterTaskServiceServer(s, &leaderHint{standby, "http://" + leaderAddr})
	})
	client, _ := NewClient(Options{Endpoint: "http://" + standbyAddr, Retry: fastRetry(), Logger: quietLogger()})
	defer client.Close()
	if _, err := client.Get(context.Background(), ByID(12)); err != nil {
		t.Fatal(err)
	}
	if client.Endpoint().String() != "http://"+leaderAddr || leader.calls != 1 {
		t.Errorf("endpoint %s, leader calls %d", client.Endpoint(), leader.calls)
	}
}

// leaderHint adds cronoq-leader to the trailers of a standby's answers.
type leaderHint struct {
	*taskServer
	leader string
}

func (h *leaderHint) GetTask(ctx context.Context, req *cronoqv1.GetTaskRequest) (*cronoqv1.GetTaskResponse, error) {
	_ = grpc.SetTrailer(ctx, metadata.Pairs("cronoq-leader", h.leader))
	return h.taskServer.GetTask(ctx, req)
}

func TestUnknownCAIsATLSErrorNotRetried(t *testing.T) {
	addr := serve(t, func(s *grpc.Server) {
		cronoqv1.RegisterTaskServiceServer(s, &taskServer{})
	}, grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{selfSigned(t)}})))
	client, _ := NewClient(Options{Endpoint: "https://" + addr, Retry: fastRetry(), Logger: quietLogger()})
	defer client.Close()
	started := time.Now()
	_, err := client.Get(context.Background(), ByID(1))
	if !errors.Is(err, ErrTLS) || errors.Is(err, ErrUnavailable) || time.Since(started) > 500*time.Millisecond {
		t.Fatalf("%v (after %v), want an ErrTLS at once", err, time.Since(started))
	}
	if want := "https://" + addr + ": TLS handshake failed: certificate verify failed: unknown CA"; !strings.HasPrefix(err.Error(), want) {
		t.Errorf("message %q, want it to start %q", err, want)
	}
}

func selfSigned(t *testing.T) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "unknown"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func TestPlainHTTPToATLSPortSaysUseHTTPS(t *testing.T) {
	addr := serve(t, func(s *grpc.Server) {
		cronoqv1.RegisterTaskServiceServer(s, &taskServer{})
	}, grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{selfSigned(t)}})))
	client, _ := NewClient(Options{Endpoint: "http://" + addr, Retry: fastRetry(), Logger: quietLogger()})
	defer client.Close()
	_, err := client.Get(context.Background(), ByID(1))
	if want := "http://" + addr + ": the server speaks TLS on this port: use https://" + addr; !errors.Is(err, ErrTLS) || err.Error() != want {
		t.Errorf("%v, want an ErrTLS %q", err, want)
	}
}

func TestAClientCertificateTheServerRequiresIsNamed(t *testing.T) {
	server := selfSigned(t)
	leaf, _ := x509.ParseCertificate(server.Certificate[0])
	roots := x509.NewCertPool()
	roots.AddCert(leaf)
	addr := serve(t, func(s *grpc.Server) {
		cronoqv1.RegisterTaskServiceServer(s, &taskServer{})
	}, grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{server}, ClientAuth: tls.RequireAnyClientCert})))
	client, _ := NewClient(Options{Endpoint: "https://" + addr, Retry: fastRetry(), Logger: quietLogger()})
	defer client.Close()
	client.conn.tlsConfig.RootCAs = roots // trust the server: only the client certificate is missing
	_, err := client.Get(context.Background(), ByID(1))
	if !errors.Is(err, ErrTLS) || !strings.Contains(err.Error(), "the server requires a client certificate") {
		t.Errorf("%v, want an ErrTLS saying a client certificate is required", err)
	}
}
