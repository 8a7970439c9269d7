package outboxui

import (
	"strconv"
	"testing"
	"time"
)

// A sign-in holds for less than OperatorSessionMax from its time, which is
// signed: an older one, one from the future (beyond a minute's skew), and
// one whose time was changed are refused.
func TestOperatorCookieExpires(t *testing.T) {
	h := &handler{opts: Options{OperatorToken: "0123456789abcdef0123"}, key: []byte("a key of the handler's")}
	now := time.Unix(1_800_000_000, 0)
	issued := now.Add(-time.Hour).Unix()
	v := h.operatorCookieValue("browser", issued)
	for _, c := range []struct {
		name  string
		value string
		at    time.Time
		want  bool
	}{
		{"an hour old", v, now, true},
		{"just under the limit", v, time.Unix(issued, 0).Add(OperatorSessionMax - time.Second), true},
		{"at the limit", v, time.Unix(issued, 0).Add(OperatorSessionMax), false},
		{"from the future", h.operatorCookieValue("browser", now.Add(2*time.Minute).Unix()), now, false},
		{"another browser's", h.operatorCookieValue("other", issued), now, false},
		{"its time changed", strconv.FormatInt(issued+3600, 10) + v[len(strconv.FormatInt(issued, 10)):], now, false},
		{"no time", v[len(strconv.FormatInt(issued, 10))+1:], now, false},
	} {
		if got := h.operatorCookieValid(c.value, "browser", c.at); got != c.want {
			t.Errorf("%s: valid = %v, want %v", c.name, got, c.want)
		}
	}
}

// Each address has its own allowance of wrong tokens, which refills at one
// per signInRefill; addresses beyond signInHosts share one.
func TestSignInLimiter(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	l := newSignInLimiter(func() time.Time { return now })
	for i := range signInBurst {
		if d := l.wait("a"); d != 0 {
			t.Fatalf("wrong token %d of a: wait %v before it", i+1, d)
		}
		if last := l.failed("a"); last != (i == signInBurst-1) {
			t.Fatalf("wrong token %d of a: last = %v", i+1, last)
		}
	}
	if d := l.wait("a"); d != signInRefill {
		t.Fatalf("a after %d wrong tokens: wait %v, want %v", signInBurst, d, signInRefill)
	}
	if d := l.wait("b"); d != 0 {
		t.Fatalf("b, which tried nothing: wait %v", d)
	}
	now = now.Add(signInRefill / 2)
	if d := l.wait("a"); d != signInRefill/2 {
		t.Fatalf("a half a refill later: wait %v, want %v", d, signInRefill/2)
	}
	now = now.Add(signInRefill / 2)
	if d := l.wait("a"); d != 0 {
		t.Fatalf("a a refill later: wait %v, want 0", d)
	}
	if !l.failed("a") {
		t.Fatal("a's one refilled try used: not reported as its last")
	}

	// A full map: recovered addresses are forgotten to make room, and
	// while none has recovered, new ones share an allowance.
	for i := len(l.hosts); i < signInHosts; i++ {
		l.failed(strconv.Itoa(i))
	}
	for i := range signInBurst {
		l.failed("new " + strconv.Itoa(i))
	}
	if d := l.wait("another new one"); d == 0 || len(l.hosts) != signInHosts+1 {
		t.Fatalf("new addresses beyond a full map: wait %v with %d remembered, want them to share one spent allowance", d, len(l.hosts))
	}
	now = now.Add(signInBurst * signInRefill)
	l.failed("c")
	if d := l.wait("c"); d != 0 || len(l.hosts) > 3 {
		t.Fatalf("c once the others recovered: wait %v with %d remembered, want 0 with the recovered forgotten", d, len(l.hosts))
	}
}

// An address's key: an IPv4 address, an IPv6 address's /64 (a site may
// take any address in it, and would otherwise get a new allowance with
// each), the address itself when it is not an IP.
func TestClientOf(t *testing.T) {
	for addr, want := range map[string]string{
		"192.0.2.7:51234":                "192.0.2.7",
		"[2001:db8:1:2:aaaa::1]:443":     "2001:db8:1:2::/64",
		"[2001:db8:1:2:bbbb:cc::9]:8080": "2001:db8:1:2::/64",
		"[::ffff:192.0.2.7]:80":          "192.0.2.7",
		"@":                              "@",
	} {
		if got := clientOf(addr); got != want {
			t.Errorf("clientOf(%q) = %q, want %q", addr, got, want)
		}
	}
}
