package cronoq

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

// TestParseEndpointAccepts: every accepted form of the endpoint grammar, and how each is
// reported (scheme://host:port, scheme and name in lower case, IPv6 in brackets).
func TestParseEndpointAccepts(t *testing.T) {
	label63 := strings.Repeat("a", 63)
	cases := []struct{ text, reported string }{
		{"http://127.0.0.1:7070", "http://127.0.0.1:7070"},
		{"https://queue.internal", "https://queue.internal:443"},
		{"queue.internal", "http://queue.internal:80"},
		{"localhost:7070", "http://localhost:7070"},
		{"HTTP://127.0.0.1:7070", "http://127.0.0.1:7070"},
		{"HtTpS://Q.Example:9", "https://q.example:9"},
		{"http://LocalHost:7070", "http://localhost:7070"},
		{"http://127.0.0.1:7070/", "http://127.0.0.1:7070"},
		{"http://queue.internal/", "http://queue.internal:80"},
		{" \thttp://127.0.0.1:7070\t ", "http://127.0.0.1:7070"},
		{"http://my_queue-1.example:7070", "http://my_queue-1.example:7070"},
		{"http://" + label63 + ".example:1", "http://" + label63 + ".example:1"},
		{"http://shard.2b:1", "http://shard.2b:1"}, // the last label has digits, not only digits
		{"http://0.0.0.0:1", "http://0.0.0.0:1"},   // "0" itself has no leading zero
		{"http://255.255.255.255:65535", "http://255.255.255.255:65535"},
		{"http://10.20.30.40:1", "http://10.20.30.40:1"},
		{"http://[::1]:7070", "http://[::1]:7070"},
		{"http://[::1]", "http://[::1]:80"},
		{"https://[::1]/", "https://[::1]:443"},
		{"http://[0:0:0:0:0:0:0:1]:1", "http://[::1]:1"},
		{"http://[2001:DB8::A]:1", "http://[2001:db8::a]:1"},
		{"http://[::FFFF:127.0.0.1]:1", "http://[::ffff:127.0.0.1]:1"},
	}
	for _, c := range cases {
		ep, err := ParseEndpoint(c.text)
		if err != nil {
			t.Errorf("ParseEndpoint(%q): %v", c.text, err)
			continue
		}
		if got := ep.String(); got != c.reported {
			t.Errorf("ParseEndpoint(%q) is reported as %q, want %q", c.text, got, c.reported)
		}
	}
}

// TestParseEndpointRefuses: every refused form, refused with INVALID_ARGUMENT naming the
// text and saying why, never read as some other endpoint.
func TestParseEndpointRefuses(t *testing.T) {
	cases := []struct{ text, why string }{
		{"", "no host"},
		{" \t ", "no host"},
		{"http://", "no host"},
		{"http:///", "no host"},
		{"http://:7070", "no host"},
		{"ftp://a:1", "scheme"},
		{"://a:1", "scheme"},
		{"http:/a:1", "path"},
		{"http://a:1/api", "path"},
		{"http://a:1//", "path"},
		{"http://a:1?x=y", "query"},
		{"http://a:1#top", "fragment"},
		{"http://user@a:1", "user info"},
		{"http://127.0.0.1@127.0.0.1:1", "user info"},
		{"http://127.0.0.%31:1", "percent-encoding"},
		{`http://a\b:1`, "backslash"},
		{"http://a b:1", "space"},
		{"http://a: 1", "space"},
		{"http://a:\t1", "tab"},
		{"\nhttp://a:1", "scheme"}, // only spaces and tabs around are ignored
		{"http://a:1\r", "port"},
		{"http://a:", "port"},
		{"http://a:0", "port"},
		{"http://a:07070", "port"},
		{"http://a:65536", "port"},
		{"http://a:99999", "port"},
		{"http://a:123456", "port"},
		{"http://a:+1", "port"},
		{"http://a:x", "port"},
		{"http://a:1:2", "port"},
		{"http://localhost.:1", "empty label"},
		{"http://a..b:1", "empty label"},
		{"http://.a:1", "empty label"},
		{"http://" + strings.Repeat("a", 64) + ":1", "longer than 63"},
		{"http://exämple.com:1", "a name has"},
		{"http://a[b:1", "a name has"},
		{"http://2130706433:1", "four parts"},
		{"http://127.1:1", "four parts"},
		{"http://1.2.3.4.5:1", "four parts"},
		{"http://shard.123:1", "four parts"},
		{"http://0177.0.0.1:1", "leading zeros"},
		{"http://1.2.3.04:1", "leading zeros"},
		{"http://00.0.0.1:1", "leading zeros"},
		{"http://0x7f.0.0.1:1", "four decimal parts"},
		{"http://0x7f000001:1", "four parts"},
		{"http://a.0X1F:1", "four parts"},
		{"http://256.0.0.1:1", "0-255"},
		{"http://1.2.3.1000:1", "0-255"},
		{"http://::1:7070", "no host"},
		{"http://[::1:7070", "no ]"},
		{"http://[]:1", "not an IPv6 address"},
		{"http://[127.0.0.1]:1", "not an IPv6 address"},
		{"http://[localhost]:1", "not an IPv6 address"},
		{"http://[::g]:1", "not an IPv6 address"},
		{"http://[fe80::1%eth0]:1", "zone"},
		{"http://[::1]x:1", "follows the IPv6 address"},
		{"http://[::1]:", "port"},
	}
	for _, c := range cases {
		ep, err := ParseEndpoint(c.text)
		switch {
		case err == nil:
			t.Errorf("ParseEndpoint(%q) = %v, want a refusal", c.text, ep)
		case !errors.Is(err, ErrInvalidArgument):
			t.Errorf("ParseEndpoint(%q): %v, want INVALID_ARGUMENT", c.text, err)
		case !strings.Contains(err.Error(), strconv.Quote(c.text)) || !strings.Contains(err.Error(), "not an endpoint"):
			t.Errorf("ParseEndpoint(%q): %q does not name the text and say it is not an endpoint", c.text, err)
		case !strings.Contains(err.Error(), c.why):
			t.Errorf("ParseEndpoint(%q): %q does not say %q", c.text, err, c.why)
		}
	}
}

func TestParseEndpoints(t *testing.T) {
	eps, err := ParseEndpoints("http://a:1, \tHTTP://B:2 ")
	if err != nil || len(eps) != 2 || eps[0].String() != "http://a:1" || eps[1].String() != "http://b:2" {
		t.Errorf("ParseEndpoints: %v, %v", eps, err)
	}
	if eps, err := ParseEndpoints("http://a:1,, http://b:2,"); err != nil || len(eps) != 2 {
		t.Errorf("ParseEndpoints with empty items: %v, %v; want them skipped", eps, err)
	}
	for _, text := range []string{"", " , ", "http://a:1,http://0177.0.0.1:2"} {
		if _, err := ParseEndpoints(text); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("ParseEndpoints(%q): %v, want INVALID_ARGUMENT", text, err)
		}
	}
}

func TestLoopback(t *testing.T) {
	cases := []struct {
		text     string
		loopback bool
	}{
		{"http://localhost:1", true},
		{"http://LOCALHOST:1", true},
		{"http://LocalHost:1", true},
		{"http://127.0.0.1:1", true},
		{"http://127.0.0.2:1", true},
		{"http://127.255.255.255:1", true},
		{"http://[::1]:1", true},
		{"http://[0:0:0:0:0:0:0:1]:1", true},
		{"http://[::ffff:127.0.0.1]:1", false},
		{"http://[::127.0.0.1]:1", false},
		{"http://[::2]:1", false},
		{"http://[::]:1", false},
		{"http://126.255.255.255:1", false},
		{"http://128.0.0.1:1", false},
		{"http://0.0.0.0:1", false},
		{"http://10.0.0.1:1", false},
		{"http://127.0.0.1.nip.io:1", false},
		{"http://localhost.example:1", false},
		{"http://my-localhost:1", false},
		{"http://example.com:1", false},
	}
	for _, c := range cases {
		ep, err := ParseEndpoint(c.text)
		if err != nil {
			t.Fatal(err)
		}
		if got := ep.Loopback(); got != c.loopback {
			t.Errorf("%s: Loopback() = %v, want %v", c.text, got, c.loopback)
		}
	}
	// Hosts no parse returns, in an Endpoint built by hand: not loopback whatever they resolve to.
	for _, host := range []string{"localhost.", "0177.0.0.1", "127.1", "2130706433", "::ffff:127.0.0.1", "::1%lo"} {
		if (Endpoint{"http", host, 1}).Loopback() {
			t.Errorf("Loopback(%q) = true", host)
		}
	}
}

// TestFollowRefusesWhatIsNotAnEndpoint: a redirect or leader target outside the grammar is
// a refused redirect with the server's code, naming the target, and the connection stays.
func TestFollowRefusesWhatIsNotAnEndpoint(t *testing.T) {
	conn, err := newConnection(&Options{Endpoint: "http://127.0.0.1:7070", Token: "t"})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		target string
		code   codes.Code
	}{
		{"http://0177.0.0.1:7071", codes.FailedPrecondition},
		{"http://127.0.0.1:7071?x=y", codes.FailedPrecondition},
		{"http://127.0.0.1@127.0.0.1:7071", codes.Unavailable},
		{"http://localhost.:7071", codes.Unavailable},
	} {
		moved, err := conn.follow(c.target, c.code)
		var e *Error
		switch {
		case moved || !errors.Is(err, ErrRedirectRefused) || !errors.As(err, &e) || e.Code != c.code:
			t.Errorf("follow(%q): moved %v, %v; want a refused redirect with code %s", c.target, moved, err, CodeName(c.code))
		case !strings.Contains(e.Message, strconv.Quote(c.target)) || !strings.Contains(e.Message, "not an endpoint"):
			t.Errorf("follow(%q): %q does not name the target and say it is not an endpoint", c.target, e.Message)
		}
		if got := conn.endpoint().String(); got != "http://127.0.0.1:7070" {
			t.Errorf("follow(%q) moved the connection to %s", c.target, got)
		}
	}
	if moved, err := conn.follow("HTTP://LocalHost:7071/", codes.FailedPrecondition); !moved || err != nil ||
		conn.endpoint().String() != "http://localhost:7071" {
		t.Errorf("follow of a loopback endpoint: moved %v, %v, now at %s", moved, err, conn.endpoint())
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
