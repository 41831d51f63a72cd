package cronoq

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
)

// MaxMessageBytes is the channel's send and receive limit.
const MaxMessageBytes = 64 << 20

// maxRedirects: a worker follows at most this many shard redirects in a row.
const maxRedirects = 3

// RetryConfig is the transport retry: UNAVAILABLE (and CANCELLED the caller did not ask
// for) is retried after InitialBackoff doubled per failure in a row, capped at MaxBackoff,
// with equal jitter (see Backoff). A worker's registration and Work stream back off the same
// way, for as long as it runs.
type RetryConfig struct {
	// InitialBackoff: 50 ms when 0.
	InitialBackoff time.Duration
	// MaxBackoff: 2 s when 0.
	MaxBackoff time.Duration
	// MaxElapsed bounds a row of retries of one call: 30 s when 0; negative: no bound (a
	// worker's own calls are retried until it stops, whatever this says).
	MaxElapsed time.Duration
}

func (r RetryConfig) withDefaults() RetryConfig {
	if r.InitialBackoff <= 0 {
		r.InitialBackoff = 50 * time.Millisecond
	}
	if r.MaxBackoff <= 0 {
		r.MaxBackoff = 2 * time.Second
	}
	if r.MaxBackoff < r.InitialBackoff {
		r.MaxBackoff = r.InitialBackoff
	}
	if r.MaxElapsed == 0 {
		r.MaxElapsed = 30 * time.Second
	}
	return r
}

// Backoff is how long to wait after failures earlier failures in a row (0 for the first):
// the step, InitialBackoff doubled per failure and capped at MaxBackoff, with equal jitter:
// half the step fixed, the other half uniformly random. Clients that failed together spread
// out, and none retries sooner than half the step.
func (r RetryConfig) Backoff(failures int) time.Duration {
	r = r.withDefaults()
	step := r.InitialBackoff << min(failures, 30)
	if step <= 0 || step > r.MaxBackoff { // <= 0: overflow
		step = r.MaxBackoff
	}
	return step/2 + time.Duration(rand.Int64N(int64(step/2)+1))
}

// healthyStream: a stream that delivered a message, or stayed open this long, was healthy:
// its end starts a new row of failures (the backoff from InitialBackoff again; MaxElapsed
// bounds a row).
const healthyStream = 5 * time.Second

// failureRow is a row of failed attempts at one thing (a registration, a Work stream): the
// delay before the next attempt (RetryConfig.Backoff), and one log line when the row starts
// and one when it ends, not one per attempt.
type failureRow struct {
	retry    RetryConfig
	log      func() *slog.Logger // the logger of the moment (the worker's, with its id)
	what     string
	failures int
}

// failed counts a failure and returns how long to wait before the next attempt.
func (f *failureRow) failed(err error, endpoint Endpoint) time.Duration {
	delay := f.retry.Backoff(f.failures)
	if f.failures == 0 {
		f.log().Warn("cronoq: "+f.what+" failed; retrying with backoff", "error", err, "endpoint", endpoint.String(),
			"max_backoff", f.retry.withDefaults().MaxBackoff)
	} else {
		f.log().Debug("cronoq: "+f.what+" failed again", "error", err, "endpoint", endpoint.String(), "after", delay)
	}
	f.failures++
	return delay
}

// succeeded: the attempt worked (a stream: it was healthy); the next failure starts a new row.
func (f *failureRow) succeeded() {
	if f.failures > 0 {
		f.log().Info("cronoq: "+f.what+" works again", "failed_attempts", f.failures)
	}
	f.failures = 0
}

// DefaultKeepaliveTime and DefaultKeepaliveTimeout: every channel pings a connection quiet
// for 20 s, with or without a call open, and drops it when the ping is not answered in 10 s.
const (
	DefaultKeepaliveTime    = 20 * time.Second
	DefaultKeepaliveTimeout = 10 * time.Second
)

// KeepaliveConfig is the channels' HTTP/2 keepalive. A server that vanished without closing
// the connection (a crash, a partition) is noticed in Time + Timeout, not the kernel's TCP
// timeout; the connection is dropped and its calls fail UNAVAILABLE, retried like any other
// (the next endpoint, the leader named). A cronoq server sends GOAWAY (too_many_pings) to a
// client that pings more often than every 10 s, and grpc-go never pings more often than that.
type KeepaliveConfig struct {
	// Time: DefaultKeepaliveTime when 0 (grpc-go raises less than 10 s to 10 s).
	Time time.Duration
	// Timeout: DefaultKeepaliveTimeout when 0.
	Timeout time.Duration
}

func (k KeepaliveConfig) params() keepalive.ClientParameters {
	if k.Time <= 0 {
		k.Time = DefaultKeepaliveTime
	}
	if k.Timeout <= 0 {
		k.Timeout = DefaultKeepaliveTimeout
	}
	// PermitWithoutStream: a client between calls notices too, not only a worker's stream.
	return keepalive.ClientParameters{Time: k.Time, Timeout: k.Timeout, PermitWithoutStream: true}
}

// TLSConfig names PEM files for https:// endpoints.
type TLSConfig struct {
	// CAFile: the CA bundle the server's certificate must chain to; the system roots when empty.
	CAFile string
	// CertFile and KeyFile: a client certificate and its unencrypted key, for servers that
	// require one (server.tls.client_ca). Give both or neither.
	CertFile, KeyFile string
}

// load reads the files once; the result is kept for every endpoint, redirects included.
func (t *TLSConfig) load() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if t == nil {
		return cfg, nil
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		return nil, newError(codes.InvalidArgument, kindCode,
			"tls: give both CertFile and KeyFile (a client certificate and its key), or neither")
	}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, newError(codes.InvalidArgument, kindCode, "tls.CAFile: cannot read %q: %v", t.CAFile, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, newError(codes.InvalidArgument, kindCode, "tls.CAFile: %q holds no PEM certificate", t.CAFile)
		}
		cfg.RootCAs = pool
	}
	if t.CertFile != "" {
		pair, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, newError(codes.InvalidArgument, kindCode,
				"tls.CertFile: %q with tls.KeyFile %q is not a PEM certificate and its unencrypted key (%v)",
				t.CertFile, t.KeyFile, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// Endpoint is one server, as parsed: Scheme "http" or "https", Host a name in lower case,
// an IPv4 address or an IPv6 address (without brackets), and Port.
type Endpoint struct {
	Scheme string
	Host   string
	Port   int
}

// ParseEndpoint reads one endpoint: [scheme "://"] host [":" port] ["/"], the grammar every
// cronoq SDK shares (the Endpoints section of conformance/README.md). The scheme is http or
// https in any case (http when absent); the host a name (labels of letters, digits, "-" and
// "_", the last not a number), an IPv4 address in dotted decimal with four parts and no
// leading zeros, or an IPv6 address in brackets; the port 1-65535 without a leading zero
// (80 or 443 when absent). Spaces and tabs around the text are ignored. Anything else (user
// info, a path, a query, a fragment, percent-encoding, a trailing dot, another IPv4 form) is
// refused, never repaired, with INVALID_ARGUMENT naming the text: what a text means must
// not depend on which parser reads it.
func ParseEndpoint(text string) (Endpoint, error) {
	ep, err := parseEndpoint(text)
	if err != nil {
		return Endpoint{}, newError(codes.InvalidArgument, kindCode, "endpoint: %q is not an endpoint: %v", text, err)
	}
	return ep, nil
}

// ParseEndpoints reads one endpoint, or several separated by commas (servers of one
// deployment); spaces and tabs around each are ignored, and so is an empty item (a
// trailing comma).
func ParseEndpoints(text string) ([]Endpoint, error) {
	var out []Endpoint
	for _, part := range strings.Split(text, ",") {
		if strings.Trim(part, " \t") == "" {
			continue
		}
		ep, err := ParseEndpoint(part)
		if err != nil {
			return nil, err
		}
		out = append(out, ep)
	}
	if len(out) == 0 {
		return nil, newError(codes.InvalidArgument, kindCode, "endpoint: %q names no endpoint", text)
	}
	return out, nil
}

// Characters no endpoint has, with what they would mean to a URL parser: named, so the
// refusal says why.
var notInEndpoint = []struct{ char, meaning string }{
	{"@", "user info (@)"},
	{"?", "a query (?)"},
	{"#", "a fragment (#)"},
	{"%", "percent-encoding or an IPv6 zone (%)"},
	{`\`, `a backslash (\)`},
	{" ", "a space inside"},
	{"\t", "a tab inside"},
}

// parseEndpoint is the one parser of endpoints: the configured ones (ParseEndpoint) and
// the targets of redirects and leader hints (connection.follow). Its error says why text
// is not an endpoint.
func parseEndpoint(text string) (Endpoint, error) {
	rest := strings.Trim(text, " \t")
	for _, c := range notInEndpoint {
		if strings.Contains(rest, c.char) {
			return Endpoint{}, fmt.Errorf("it has %s", c.meaning)
		}
	}
	ep := Endpoint{Scheme: "http"}
	if scheme, after, found := strings.Cut(rest, "://"); found {
		ep.Scheme = strings.ToLower(scheme)
		if ep.Scheme != "http" && ep.Scheme != "https" {
			return Endpoint{}, errors.New("the scheme is not http:// or https://")
		}
		rest = after
	}
	rest = strings.TrimSuffix(rest, "/")
	if strings.Contains(rest, "/") {
		return Endpoint{}, errors.New("it has a path (only one / may end it)")
	}
	var port string
	var hasPort bool
	if strings.HasPrefix(rest, "[") {
		end := strings.Index(rest, "]")
		if end < 0 {
			return Endpoint{}, errors.New("the [ of an IPv6 address has no ]")
		}
		host := rest[1:end]
		ip, err := netip.ParseAddr(host)
		if err != nil || !ip.Is6() {
			return Endpoint{}, fmt.Errorf("[%s] is not an IPv6 address", host)
		}
		ep.Host = ip.String()
		switch after := rest[end+1:]; {
		case after == "":
		case strings.HasPrefix(after, ":"):
			port, hasPort = after[1:], true
		default:
			return Endpoint{}, fmt.Errorf("%q follows the IPv6 address", after)
		}
	} else {
		var host string
		host, port, hasPort = strings.Cut(rest, ":")
		h, err := parseHost(host)
		if err != nil {
			return Endpoint{}, err
		}
		ep.Host = h
	}
	ep.Port = 80
	if ep.Secure() {
		ep.Port = 443
	}
	if hasPort {
		n, err := parsePort(port)
		if err != nil {
			return Endpoint{}, err
		}
		ep.Port = n
	}
	return ep, nil
}

// maxLabel is the longest label of a host name, as DNS allows.
const maxLabel = 63

// parseHost reads a host that is not in brackets: an IPv4 address when its last label is
// a number, decimal or 0x hex (then it must be the canonical dotted decimal form, so that no parser reads
// 2130706433, 0177.0.0.1 or 127.1 as an address another would not), else a name, returned
// in lower case.
func parseHost(host string) (string, error) {
	if host == "" {
		return "", errors.New("it has no host")
	}
	labels := strings.Split(host, ".")
	for _, label := range labels {
		if label == "" {
			return "", fmt.Errorf("the host %q has an empty label (a trailing dot, or two dots in a row)", host)
		}
		if len(label) > maxLabel {
			return "", fmt.Errorf("the host %q has a label longer than %d characters", host, maxLabel)
		}
		for _, r := range label {
			if !isLabelChar(r) {
				return "", fmt.Errorf("the host %q has %q (a name has letters, digits, - and _)", host, r)
			}
		}
	}
	if !isNumber(labels[len(labels)-1]) {
		return strings.ToLower(host), nil
	}
	if len(labels) != 4 {
		return "", fmt.Errorf("the host %q ends in a number but is not an IPv4 address of four parts", host)
	}
	for _, part := range labels {
		if !allDigits(part) || (len(part) > 1 && part[0] == '0') || len(part) > 3 || atoi(part) > 255 {
			return "", fmt.Errorf("the host %q ends in a number but is not an IPv4 address of four decimal parts 0-255 without leading zeros", host)
		}
	}
	return host, nil
}

// parsePort reads a port: 1-65535 in decimal, no leading zero.
func parsePort(port string) (int, error) {
	if !allDigits(port) || port[0] == '0' || len(port) > 5 || atoi(port) > 65535 {
		return 0, fmt.Errorf("the port %q is not 1-65535 in decimal without a leading zero", port)
	}
	return atoi(port), nil
}

func isLabelChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_'
}

// isNumber reports whether an address parser reads label as a number: decimal digits, or
// 0x and hex digits (inet_aton reads 0x7f000001 as 127.0.0.1).
func isNumber(label string) bool {
	if hex, ok := strings.CutPrefix(strings.ToLower(label), "0x"); ok {
		return strings.Trim(hex, "0123456789abcdef") == ""
	}
	return allDigits(label)
}

// allDigits reports whether s is one or more ASCII digits.
func allDigits(s string) bool {
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return s != ""
}

// atoi reads a string of at most 5 ASCII digits (allDigits checked).
func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

// Secure reports whether the endpoint is https://.
func (e Endpoint) Secure() bool { return e.Scheme == "https" }

// Target is host:port as gRPC dials it.
func (e Endpoint) Target() string { return net.JoinHostPort(e.Host, strconv.Itoa(e.Port)) }

// String is how an endpoint is reported: scheme://host:port, an IPv6 address in brackets.
func (e Endpoint) String() string { return e.Scheme + "://" + e.Target() }

// Loopback reports whether the host is loopback: exactly localhost (any case), an address
// of 127.0.0.0/8, or ::1. Not an IPv4-mapped ::ffff:127.0.0.1, not localhost. nor any
// name that resolves to loopback: a token goes over plain http:// only to these.
func (e Endpoint) Loopback() bool {
	if strings.EqualFold(e.Host, "localhost") {
		return true
	}
	ip, err := netip.ParseAddr(e.Host)
	if err != nil {
		return false
	}
	if ip.Is4() {
		return ip.As4()[0] == 127
	}
	return ip == netip.IPv6Loopback()
}

// CheckRedirect applies the connection rules to following a redirect (or a standby's
// leader hint) from current to target: never from https:// to http://, and a bearer token
// goes over plain http:// only to a loopback host unless insecureRedirectHTTP is set.
func CheckRedirect(current, target Endpoint, hasToken, insecureRedirectHTTP bool) error {
	if current.Secure() && !target.Secure() {
		return newError(codes.FailedPrecondition, kindRedirectRefused,
			"redirect from %s to %s refused: never follow https:// to http://", current, target)
	}
	if hasToken && !target.Secure() && !target.Loopback() && !insecureRedirectHTTP {
		return newError(codes.FailedPrecondition, kindRedirectRefused,
			"redirect to %s refused: the token would go over plain http:// to a non-loopback host "+
				"(set InsecureRedirectHTTP, insecure_redirect_http, on trusted networks only)", target)
	}
	return nil
}

// connection is a channel to one server of the configured endpoints, moved on
// UNAVAILABLE: to the leader a standby names (within the redirect rules), else to the next
// configured endpoint. Channels are kept per endpoint until close.
type connection struct {
	configured []Endpoint
	token      string
	tlsConfig  *tls.Config
	tlsFiles   *TLSConfig // the file names, for messages
	insecure   bool       // follow redirects to plain http:// on other hosts with the token
	retry      RetryConfig
	keepalive  keepalive.ClientParameters
	timeout    time.Duration
	log        *slog.Logger

	mu      sync.Mutex
	current Endpoint
	next    int
	conns   map[Endpoint]*grpc.ClientConn
}

func newConnection(o *Options) (*connection, error) {
	configured, err := ParseEndpoints(o.Endpoint)
	if err != nil {
		return nil, err
	}
	tlsConfig, err := o.TLS.load()
	if err != nil {
		return nil, err
	}
	return &connection{
		configured: configured,
		token:      o.Token,
		tlsConfig:  tlsConfig,
		tlsFiles:   o.TLS,
		insecure:   o.InsecureRedirectHTTP,
		retry:      o.Retry.withDefaults(),
		keepalive:  o.Keepalive.params(),
		timeout:    o.timeout(),
		log:        o.logger(),
		current:    configured[0],
		conns:      map[Endpoint]*grpc.ClientConn{},
	}, nil
}

// endpoint is the server calls go to now.
func (c *connection) endpoint() Endpoint {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.current
}

// isConfigured reports whether ep is one of the configured endpoints.
func (c *connection) isConfigured(ep Endpoint) bool {
	for _, e := range c.configured {
		if e == ep {
			return true
		}
	}
	return false
}

// channel is the channel to the current endpoint (opened on first use) and that endpoint.
func (c *connection) channel() (*grpc.ClientConn, Endpoint, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ep := c.current
	if cc, ok := c.conns[ep]; ok {
		return cc, ep, nil
	}
	creds := insecure.NewCredentials()
	if ep.Secure() {
		creds = credentials.NewTLS(c.tlsConfig.Clone())
	}
	cc, err := grpc.NewClient(ep.Target(),
		grpc.WithTransportCredentials(creds),
		grpc.WithDisableRetry(),
		grpc.WithUserAgent("cronoq-go/"+Version), // first in the user-agent; grpc-go's own follows
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxMessageBytes), grpc.MaxCallSendMsgSize(MaxMessageBytes)),
		// Reconnect as fast as the SDK's own retries, not gRPC's default (1 s, growing to 2 min).
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: c.retry.InitialBackoff, Multiplier: 2, Jitter: 0.2, MaxDelay: c.retry.MaxBackoff},
			MinConnectTimeout: 5 * time.Second,
		}),
		grpc.WithKeepaliveParams(c.keepalive),
	)
	if err != nil {
		return nil, ep, newError(codes.InvalidArgument, kindCode, "endpoint %s: %v", ep, err)
	}
	c.conns[ep] = cc
	return cc, ep, nil
}

// follow moves to target, a redirect's or a leader hint's, if it is an endpoint and the
// connection rules allow it, and reports whether that changed the endpoint. code is the
// gRPC code of the answer that named target: a refusal keeps it.
func (c *connection) follow(target string, code codes.Code) (bool, error) {
	dest, err := parseEndpoint(target)
	if err != nil {
		return false, newError(code, kindRedirectRefused, "redirect to %q refused: not an endpoint: %v", target, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := CheckRedirect(c.current, dest, c.token != "", c.insecure); err != nil {
		return false, err
	}
	moved := dest != c.current
	c.current = dest
	return moved, nil
}

// onUnavailable moves after an UNAVAILABLE: to the leader it names, else (with several
// endpoints, or away from a redirect target) to the next configured endpoint.
func (c *connection) onUnavailable(err error) {
	var e *Error
	if asError(err, &e) && e.Leader != "" {
		moved, ferr := c.follow(e.Leader, e.Code)
		if moved {
			return
		}
		if ferr != nil {
			c.log.Warn("cronoq: not following the leader", "leader", e.Leader, "error", ferr)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.configured) > 1 || c.current != c.configured[0] {
		c.next = (c.next + 1) % len(c.configured)
		c.current = c.configured[c.next]
	}
}

// outgoing adds the token to a call's context.
func (c *connection) outgoing(ctx context.Context) context.Context {
	if c.token == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
}

// once runs call once on the current endpoint, with the token and a timeout (0: none),
// and translates its error to the SDK's (a failed TLS handshake is an ErrTLS).
func (c *connection) once(ctx context.Context, timeout time.Duration, call func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error) error {
	cc, ep, err := c.channel()
	if err != nil {
		return err
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	var trailer metadata.MD
	err = call(c.outgoing(ctx), cc, grpc.Trailer(&trailer))
	return c.diagnose(ep, fromGRPC(err, trailer))
}

// invoke runs call with the transport retries: UNAVAILABLE and CANCELLED (that ctx did
// not cause) are retried with backoff, moving to the leader or the next endpoint, until
// the retry's MaxElapsed.
func (c *connection) invoke(ctx context.Context, what string, timeout time.Duration, call func(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error) error {
	started := time.Now()
	for failures := 0; ; failures++ {
		err := c.once(ctx, timeout, call)
		if err == nil || !retryable(err) {
			return err
		}
		if ctx.Err() != nil {
			return err
		}
		if c.retry.MaxElapsed > 0 && time.Since(started) >= c.retry.MaxElapsed {
			return err
		}
		c.onUnavailable(err)
		delay := c.retry.Backoff(failures)
		c.log.Debug("cronoq: retrying", "call", what, "error", err, "endpoint", c.endpoint(), "after", delay)
		if err := sleep(ctx, delay); err != nil {
			return err
		}
	}
}

func (c *connection) close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	var first error
	for ep, cc := range c.conns {
		if err := cc.Close(); err != nil && first == nil {
			first = err
		}
		delete(c.conns, ep)
	}
	return first
}

// sleep waits d, or returns ctx's error first.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// What gRPC's transport says of a failed handshake, and what that means.
var tlsReasons = []struct{ marker, reason string }{
	{"certificate signed by unknown authority", "certificate verify failed: unknown CA (the server's certificate is not signed by a trusted CA)"},
	{"certificate has expired", "certificate verify failed: the server's certificate has expired or is not yet valid"},
	{"is not valid for", "hostname mismatch: the server's certificate is not valid for %s"},
	{"certificate is valid for", "hostname mismatch: the server's certificate is not valid for %s"},
	{"certificate required", "the server requires a client certificate (none given: set TLSConfig.CertFile and KeyFile)"},
	{"unknown certificate authority", "the server refused the client certificate (not signed by a CA in its server.tls.client_ca)"},
	{"bad certificate", "the server refused the client certificate (not signed by a CA in its server.tls.client_ca, or expired)"},
	{"expired certificate", "the server refused the client certificate: it has expired"},
	{"first record does not look like a TLS handshake", "the server does not speak TLS on this port: is it an http:// endpoint?"},
	{"no application protocol", "the server does not speak gRPC (HTTP/2) here: is this its HTTP port rather than its gRPC port?"},
	{"missing selected ALPN property", "the server does not speak gRPC (HTTP/2) here: is this its HTTP port rather than its gRPC port?"},
}

// diagnose turns an UNAVAILABLE that is a failed TLS handshake with ep into an ErrTLS.
// gRPC names most handshake failures; a server that refuses the client's certificate
// (TLS 1.3) or that speaks TLS to a plaintext client just closes the connection, which a
// probe tells apart from a server going away.
func (c *connection) diagnose(ep Endpoint, err error) error {
	var e *Error
	if !asError(err, &e) || e.Code != codes.Unavailable || e.kind != kindCode {
		return err
	}
	msg := e.Message
	closed := strings.Contains(msg, "error reading server preface") || strings.Contains(msg, "connection reset") ||
		strings.Contains(msg, "connection closed")
	reason := ""
	switch {
	case !ep.Secure():
		if closed && probeSpeaksTLS(ep) {
			secure := ep
			secure.Scheme = "https"
			out := *e
			out.kind = kindTLS
			out.Message = fmt.Sprintf("%s: the server speaks TLS on this port: use %s", ep, secure)
			return &out
		}
		return err
	case strings.Contains(msg, "authentication handshake failed") || strings.Contains(msg, "remote error: tls:") ||
		strings.Contains(msg, "x509:"):
		reason = tlsReason(msg, ep, c.tlsFiles)
	case closed:
		reason = probeTLS(ep, c.tlsConfig, c.tlsFiles)
	}
	if reason == "" {
		return err
	}
	out := *e
	out.kind = kindTLS
	out.Message = fmt.Sprintf("%s: TLS handshake failed: %s (%s)", ep, reason, strings.TrimSpace(msg))
	return &out
}

// tlsReason says what a handshake error means.
func tlsReason(msg string, ep Endpoint, files *TLSConfig) string {
	for _, r := range tlsReasons {
		if strings.Contains(msg, r.marker) {
			if strings.Contains(r.reason, "%s") {
				return fmt.Sprintf(r.reason, strconv.Quote(ep.Host))
			}
			if strings.HasPrefix(r.reason, "the server refused the client certificate") ||
				strings.HasPrefix(r.reason, "the server requires a client certificate") {
				return clientCertReason(files)
			}
			return r.reason
		}
	}
	if i := strings.Index(msg, "handshake failed: "); i >= 0 {
		return strings.TrimSuffix(msg[i+len("handshake failed: "):], `"`)
	}
	return msg
}

// clientCertReason: why a server that closes the connection after the handshake refused this client.
func clientCertReason(files *TLSConfig) string {
	if files == nil || files.CertFile == "" {
		return "the server requires a client certificate (none given: set TLSConfig.CertFile and KeyFile)"
	}
	if pair, err := tls.LoadX509KeyPair(files.CertFile, files.KeyFile); err == nil && len(pair.Certificate) > 0 {
		if leaf, err := x509.ParseCertificate(pair.Certificate[0]); err == nil {
			now := time.Now()
			if now.After(leaf.NotAfter) {
				return fmt.Sprintf("the client certificate %q has expired (on %s UTC)", files.CertFile, leaf.NotAfter.UTC().Format("2006-01-02 15:04"))
			}
			if now.Before(leaf.NotBefore) {
				return fmt.Sprintf("the client certificate %q is not yet valid", files.CertFile)
			}
		}
	}
	return fmt.Sprintf("the server refused the client certificate %q (not signed by a CA in its server.tls.client_ca, or expired)", files.CertFile)
}

// probeTimeout bounds each step of a probe.
const probeTimeout = 3 * time.Second

// The HTTP/2 client connection preface and an empty SETTINGS frame.
var h2Preface = []byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")

// probeTLS is why a TLS connection to ep fails, or "" if it does not, or if the server
// cannot be reached at all (that is no TLS problem).
func probeTLS(ep Endpoint, cfg *tls.Config, files *TLSConfig) string {
	raw, err := net.DialTimeout("tcp", ep.Target(), probeTimeout)
	if err != nil {
		return ""
	}
	defer raw.Close()
	_ = raw.SetDeadline(time.Now().Add(probeTimeout))
	cfg = cfg.Clone()
	cfg.ServerName, cfg.NextProtos = ep.Host, []string{"h2"}
	conn := tls.Client(raw, cfg)
	if err := conn.Handshake(); err != nil {
		if isTimeout(err) {
			return ""
		}
		return tlsReason(err.Error(), ep, files)
	}
	// TLS 1.3: the server checks the client's certificate after the client's side of the
	// handshake; one that refuses it closes the connection, one that accepts it answers the
	// HTTP/2 preface with its SETTINGS.
	if _, err := conn.Write(h2Preface); err != nil {
		return clientCertReason(files)
	}
	var b [1]byte
	if _, err := conn.Read(b[:]); err != nil && !isTimeout(err) {
		if strings.Contains(err.Error(), "remote error: tls:") {
			return tlsReason(err.Error(), ep, files)
		}
		return clientCertReason(files)
	}
	return ""
}

// probeSpeaksTLS reports whether a TLS handshake (unverified) with ep completes, or is
// refused with a TLS alert: a TLS server on a port the client was told is plaintext.
func probeSpeaksTLS(ep Endpoint) bool {
	raw, err := net.DialTimeout("tcp", ep.Target(), probeTimeout)
	if err != nil {
		return false
	}
	defer raw.Close()
	_ = raw.SetDeadline(time.Now().Add(probeTimeout))
	conn := tls.Client(raw, &tls.Config{InsecureSkipVerify: true, ServerName: ep.Host}) //nolint:gosec // a probe: nothing is sent
	err = conn.Handshake()
	return err == nil || strings.Contains(err.Error(), "remote error: tls:")
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
