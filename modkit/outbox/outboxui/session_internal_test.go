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
