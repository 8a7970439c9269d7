package outboxui

import (
	"encoding/json"
	"net/http"

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
// Problems quote no error text (see outbox.Health); Health.ClaimError,
// which may quote the database's, is not served.
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
			problems := h.Problems
			if problems == nil {
				problems = []string{}
			}
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
