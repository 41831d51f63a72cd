package cronoq

import (
	"log/slog"
	"time"
)

// Options configure a Client, and the connection of a Worker.
type Options struct {
	// Endpoint: "http://host:port" or "https://host:port" (the grammar: ParseEndpoint), or
	// several separated by commas (servers of one deployment, tried in turn).
	// http://127.0.0.1:7070 when empty.
	Endpoint string
	// Token is sent as "authorization: Bearer <token>" with every call; empty: none.
	Token string
	// TLS: the CA and the client certificate for https:// endpoints, kept across redirects.
	TLS *TLSConfig
	// InsecureRedirectHTTP lets a worker follow a redirect to plain http:// on a host that
	// is not loopback with its token (trusted networks only).
	InsecureRedirectHTTP bool
	// Retry: the transport retries of UNAVAILABLE.
	Retry RetryConfig
	// Keepalive: the HTTP/2 keepalive that notices a server gone silent (20 s, 10 s when zero).
	Keepalive KeepaliveConfig
	// Timeout of each call (each attempt of it): 30 s when 0.
	Timeout time.Duration
	// Logger: slog.Default() when nil.
	Logger *slog.Logger
}

// DefaultEndpoint is where a Client or Worker without Endpoint connects.
const DefaultEndpoint = "http://127.0.0.1:7070"

func (o *Options) timeout() time.Duration {
	if o.Timeout > 0 {
		return o.Timeout
	}
	return 30 * time.Second
}

func (o *Options) logger() *slog.Logger {
	if o.Logger != nil {
		return o.Logger
	}
	return slog.Default()
}

func (o Options) withDefaults() Options {
	if o.Endpoint == "" {
		o.Endpoint = DefaultEndpoint
	}
	return o
}
