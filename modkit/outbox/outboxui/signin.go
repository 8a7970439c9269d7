package outboxui

import (
	"net"
	"net/netip"
	"sync"
	"time"
)

// Wrong operator tokens are limited per client address, so that a flood of
// them fills neither the log nor the server: an address may get
// signInBurst wrong at once, then one more each signInRefill (ten a
// minute), each answered 403 and logged. Beyond that its wrong tokens are
// answered 429 with Retry-After, and the log says so once. The token is
// still compared, and the right one signs in whatever the address's
// allowance: a visitor sharing the operator's address (behind a proxy or
// a NAT) cannot lock the operator out by spending it. What makes guessing
// hopeless is the token itself (TokenMinLen random characters), not this
// limit.
const (
	signInBurst  = 10
	signInRefill = 6 * time.Second
	// signInHosts bounds the addresses remembered. When that many are
	// remembered and none has recovered its whole allowance, the addresses
	// beyond them share one allowance.
	signInHosts = 4096
)

// signInLimiter counts wrong operator tokens per remote host.
type signInLimiter struct {
	mu    sync.Mutex
	now   func() time.Time
	hosts map[string]*signInAllowance
}

// signInAllowance is a host's wrong tokens left (at most signInBurst) as
// of at.
type signInAllowance struct {
	left float64
	at   time.Time
}

func newSignInLimiter(now func() time.Time) *signInLimiter {
	return &signInLimiter{now: now, hosts: map[string]*signInAllowance{}}
}

// clientOf is the key of an http.Request's RemoteAddr in the limiter: its
// IPv4 address, or the /64 of its IPv6 address (one site's, which can
// take any address in it), or the string itself when it is neither.
// Headers such as X-Forwarded-For are not read: behind a proxy every
// visitor shares the proxy's allowance.
func clientOf(remoteAddr string) string {
	host := remoteAddr
	if h, _, err := net.SplitHostPort(remoteAddr); err == nil {
		host = h
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	if ip = ip.Unmap(); ip.Is6() {
		if p, err := ip.Prefix(64); err == nil {
			return p.String()
		}
	}
	return ip.String()
}

// refill brings a's allowance up to now.
func (a *signInAllowance) refill(now time.Time) {
	if d := now.Sub(a.at); d > 0 {
		a.left = min(signInBurst, a.left+float64(d)/float64(signInRefill))
		a.at = now
	}
}

// wait is how long host's allowance takes to hold a wrong token again (0:
// it holds one now).
func (l *signInLimiter) wait(host string) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	a, ok := l.allowance(host, now)
	if !ok {
		return 0
	}
	a.refill(now)
	if a.left >= 1 {
		return 0
	}
	return time.Duration((1 - a.left) * float64(signInRefill))
}

// failed records a wrong token from host and reports whether that was its
// last: its next sign-in will be refused until its allowance refills.
func (l *signInLimiter) failed(host string) (last bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	a, ok := l.allowance(host, now)
	if !ok {
		a = &signInAllowance{left: signInBurst, at: now}
		l.hosts[l.key(host)] = a
	}
	a.refill(now)
	a.left = max(0, a.left-1)
	return a.left < 1
}

// allowance returns host's allowance, if it has one. A host not
// remembered while the map is full first makes room by forgetting the
// hosts whose allowance is whole again (they are as if never seen); if
// none has, it shares the allowance kept under "".
func (l *signInLimiter) allowance(host string, now time.Time) (*signInAllowance, bool) {
	if a, ok := l.hosts[host]; ok {
		return a, true
	}
	if len(l.hosts) >= signInHosts {
		for h, a := range l.hosts {
			if a.refill(now); a.left >= signInBurst {
				delete(l.hosts, h)
			}
		}
	}
	a, ok := l.hosts[l.key(host)]
	return a, ok
}

// key is where host's allowance is kept: under host, or under "" (shared)
// when host is not remembered and the map is full.
func (l *signInLimiter) key(host string) string {
	if _, ok := l.hosts[host]; ok || len(l.hosts) < signInHosts {
		return host
	}
	return ""
}
