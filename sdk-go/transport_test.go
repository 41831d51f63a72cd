package cronoq

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func TestParseEndpoint(t *testing.T) {
	good := map[string]Endpoint{
		"http://127.0.0.1:7070":  {"http", "127.0.0.1", 7070},
		"https://queue.internal": {"https", "queue.internal", 443},
		"localhost:7070":         {"http", "localhost", 7070},
		"http://[::1]:7070/":     {"http", "::1", 7070},
		" https://q.example:9 ":  {"https", "q.example", 9},
	}
	for text, want := range good {
		got, err := ParseEndpoint(text)
		if err != nil || got != want {
			t.Errorf("ParseEndpoint(%q) = %v, %v; want %v", text, got, err, want)
		}
	}
	if got, _ := ParseEndpoint("http://[::1]:7070"); got.String() != "http://[::1]:7070" || got.Target() != "[::1]:7070" {
		t.Errorf("IPv6 endpoint prints as %q", got.String())
	}
	for _, bad := range []string{"ftp://a:1", "http://", "http://a:0", "http://a:99999", "http://a:1/path", "http://a:x"} {
		if _, err := ParseEndpoint(bad); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("ParseEndpoint(%q): %v, want an INVALID_ARGUMENT error", bad, err)
		}
	}
	eps, err := ParseEndpoints("http://a:1, http://b:2,")
	if err != nil || len(eps) != 2 || eps[1].Host != "b" {
		t.Errorf("ParseEndpoints: %v, %v", eps, err)
	}
	if _, err := ParseEndpoints(" , "); err == nil {
		t.Error("ParseEndpoints of no endpoint must fail")
	}
}

func TestLoopback(t *testing.T) {
	for host, want := range map[string]bool{"localhost": true, "127.0.0.1": true, "127.8.0.1": true, "::1": true, "10.0.0.1": false, "example.com": false} {
		if got := (Endpoint{"http", host, 1}).Loopback(); got != want {
			t.Errorf("Loopback(%s) = %v", host, got)
		}
	}
}

func TestCheckRedirect(t *testing.T) {
	ep := func(s string) Endpoint {
		e, err := ParseEndpoint(s)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	cases := []struct {
		from, to        string
		token, insecure bool
		refused         string // a phrase of the refusal; "" when followed
	}{
		{"http://127.0.0.1:1", "http://127.0.0.1:2", true, false, ""},
		{"http://127.0.0.1:1", "http://localhost:2", true, false, ""},
		{"https://a.example:1", "https://b.example:2", true, false, ""},
		{"http://a.example:1", "https://b.example:2", true, false, ""},
		{"https://a.example:1", "http://127.0.0.1:2", true, false, "https:// to http://"},
		{"https://a.example:1", "http://127.0.0.1:2", false, true, "https:// to http://"},
		{"http://127.0.0.1:1", "http://10.0.0.2:2", true, false, "insecure_redirect_http"},
		{"http://127.0.0.1:1", "http://10.0.0.2:2", true, true, ""},
		{"http://127.0.0.1:1", "http://10.0.0.2:2", false, false, ""},
	}
	for _, c := range cases {
		err := CheckRedirect(ep(c.from), ep(c.to), c.token, c.insecure)
		switch {
		case c.refused == "" && err != nil:
			t.Errorf("%s -> %s (token %v, insecure %v): refused: %v", c.from, c.to, c.token, c.insecure, err)
		case c.refused != "" && (!errors.Is(err, ErrRedirectRefused) || !errors.Is(err, ErrFailedPrecondition)):
			t.Errorf("%s -> %s (token %v, insecure %v): %v, want a refusal", c.from, c.to, c.token, c.insecure, err)
		case c.refused != "" && !strings.Contains(err.Error(), c.refused):
			t.Errorf("%s -> %s: %q does not say %q", c.from, c.to, err, c.refused)
		}
	}
}

func TestRetryDefaultsAndBackoff(t *testing.T) {
	r := RetryConfig{}.withDefaults()
	if r.InitialBackoff != 50*time.Millisecond || r.MaxBackoff != 2*time.Second || r.MaxElapsed != 30*time.Second {
		t.Errorf("defaults: %+v", r)
	}
	if (RetryConfig{MaxElapsed: -1}).withDefaults().MaxElapsed >= 0 {
		t.Error("a negative MaxElapsed (no bound) must stay negative")
	}
	// Equal jitter: the step (doubled per failure, capped) is half fixed, half random.
	r = RetryConfig{InitialBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond}
	for failures := 0; failures < 100; failures++ {
		step := min(10*time.Millisecond<<min(failures, 30), 100*time.Millisecond)
		lo, hi := step, time.Duration(0)
		for range 200 {
			d := r.Backoff(failures)
			if d < step/2 || d > step {
				t.Fatalf("Backoff(%d) = %v outside [%v, %v]", failures, d, step/2, step)
			}
			lo, hi = min(lo, d), max(hi, d)
		}
		if hi-lo < step/4 {
			t.Fatalf("Backoff(%d) in [%v, %v]: not jittered", failures, lo, hi)
		}
	}
}

func TestTLSConfigNeedsCertAndKeyTogether(t *testing.T) {
	if _, err := (&TLSConfig{CertFile: "w.crt"}).load(); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a cert without its key: %v", err)
	}
	if _, err := (&TLSConfig{CAFile: "/nonexistent/ca.pem"}).load(); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("an unreadable CA file: %v", err)
	}
	if _, err := NewClient(Options{Endpoint: "https://a:1", TLS: &TLSConfig{KeyFile: "k"}}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("NewClient with a key and no cert: %v", err)
	}
}
