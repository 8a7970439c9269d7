package outboxui

import (
	"encoding/json"
	"net/http"
	"strings"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// HealthHandler serves the Health of dispatchers as JSON, for readiness
// probes and monitors. It answers 200 when every dispatcher is running
// (ready: its first claim succeeded, and it is not stopping) and 503
// otherwise. A degraded dispatcher (a publisher hangs, claims fail) still
// answers 200 with "degraded" in the body: taking the process out of
// service or restarting it rarely mends a hanging publisher or an
// unreachable database; alert on the outbox.dispatcher.degraded gauge, or
// on the body, instead. Nil dispatchers are skipped (an fx app without
// publishers has none), and with none it answers 200.
//
// A problem "claims failing since …" leaves out the claim's error, which
// may quote the database's error text: the dispatcher logs it ("claim
// failed; retrying").
//
// It shows no events and takes no action, so unlike the dashboard it may
// be mounted where probes reach it without signing in.
func HealthHandler(dispatchers ...*outbox.Dispatcher) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "use GET", http.StatusMethodNotAllowed)
			return
		}
		type dispatcherHealth struct {
			WorkerID  string   `json:"worker_id"`
			State     string   `json:"state"`
			Ready     bool     `json:"ready"`
			Degraded  bool     `json:"degraded"`
			Problems  []string `json:"problems"`
			Abandoned int      `json:"abandoned_publishes"`
		}
		body := struct {
			Status      string             `json:"status"`
			Dispatchers []dispatcherHealth `json:"dispatchers"`
		}{Status: "ok", Dispatchers: []dispatcherHealth{}}
		code := http.StatusOK
		for _, d := range dispatchers {
			if d == nil {
				continue
			}
			h := d.Health()
			problems := publicProblems(h.Problems)
			body.Dispatchers = append(body.Dispatchers, dispatcherHealth{WorkerID: d.Config().WorkerID.String(), State: h.State(),
				Ready: h.Running, Degraded: h.Degraded, Problems: problems, Abandoned: h.Abandoned})
			if !h.Running {
				code, body.Status = http.StatusServiceUnavailable, "unavailable"
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(body)
	})
}

// claimsFailing begins the Health problem of failing claims, "claims
// failing since <RFC 3339 time>: <error>".
const claimsFailing = "claims failing since "

// publicProblems returns Health.Problems fit to show anyone who reaches the
// dashboard or the health handler (never nil): the claim's error is left
// out of "claims failing since …", as it may quote SQL or the database's
// address. The dispatcher logs that error itself.
func publicProblems(problems []string) []string {
	out := make([]string, len(problems))
	for i, p := range problems {
		if since, ok := strings.CutPrefix(p, claimsFailing); ok {
			since, _, _ = strings.Cut(since, ": ") // an RFC 3339 time has no ": "
			p = claimsFailing + since + " (the dispatcher's log has the error: \"claim failed; retrying\")"
		}
		out[i] = p
	}
	return out
}
