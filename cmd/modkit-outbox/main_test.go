package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/driver"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var (
	bg     = context.Background()
	orders = outbox.Topic{Namespace: "shop", Topic: "order_paid"}
	mails  = outbox.Topic{Namespace: "crm", Topic: "welcome_mail"}
)

// result is one run of the command.
type result struct {
	code           int
	stdout, stderr string
}

// cli runs the command in-process against dsn ("" for no DATABASE_URL),
// with stdin as a non-interactive input.
func cli(t *testing.T, dsn string, args ...string) result {
	t.Helper()
	return cliEnv(t, map[string]string{"DATABASE_URL": dsn}, args...)
}

// cliEnv is cli with the environment variables vars.
func cliEnv(t *testing.T, vars map[string]string, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	e := env{stdin: strings.NewReader(""), stdout: &out, stderr: &errOut,
		getenv: func(k string) string { return vars[k] }}
	code := run(bg, e, args)
	return result{code, out.String(), errOut.String()}
}

func (r result) must(t *testing.T, code int) result {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", r.code, code, r.stdout, r.stderr)
	}
	return r
}

// fixture is a migrated database with a client and the driver's store to
// move events into the states the tests start from.
type fixture struct {
	dsn    string
	pool   *pgxpool.Pool
	client *outbox.Client
	store  driver.Store
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	tdb := pgtest.NewDB(t)
	c, err := outbox.New(outboxpg.New(tdb.Provider.Pool), outbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := outboxpg.New(tdb.Provider.Pool).Open(driver.Options{Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{dsn: tdb.DSN, pool: tdb.Provider.Pool, client: c, store: st}
}

func (f *fixture) enqueue(t *testing.T, topic outbox.Topic, n int) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for i := range n {
		r, err := f.client.Enqueue(bg, f.pool, outbox.Message{Namespace: topic.Namespace, Topic: topic.Topic,
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d,"secret":"s3cr3t"}`, i))})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, r.ID)
	}
	return ids
}

// settle claims up to n due events of topic and records kind for each.
func (f *fixture) settle(t *testing.T, topic outbox.Topic, n int, kind driver.OutcomeKind, delay time.Duration) []uuid.UUID {
	t.Helper()
	worker := uuid.New()
	claimed, err := f.store.Claim(bg, driver.ClaimParams{Topics: []string{topic.Namespace + ":" + topic.Topic}, Limit: n,
		MaxAttempts: 5, Worker: worker, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	outcomes := make([]driver.Outcome, len(claimed))
	ids := make([]uuid.UUID, len(claimed))
	for i, c := range claimed {
		outcomes[i] = driver.Outcome{ID: c.ID, LeaseToken: c.LeaseToken, Kind: kind, Error: "boom: consumer said no", Delay: delay}
		ids[i] = c.ID
	}
	if _, err := f.store.Complete(bg, nil, worker, outcomes); err != nil {
		t.Fatal(err)
	}
	return ids
}

func (f *fixture) status(t *testing.T, id uuid.UUID) outbox.Status {
	t.Helper()
	ev, err := f.client.Admin().Get(bg, id)
	if err != nil {
		t.Fatal(err)
	}
	return ev.Status
}

// deliverAll runs a dispatcher for topic until want events were published,
// then stops it.
func (f *fixture) deliverAll(t *testing.T, topic outbox.Topic, want int) {
	t.Helper()
	var mu sync.Mutex
	got := 0
	done := make(chan struct{})
	d, err := f.client.NewDispatcher(outbox.DispatcherConfig{PollInterval: 20 * time.Millisecond,
		OnOutcome: func(_ outbox.Delivery, o outbox.Outcome) {
			if o.Status == outbox.StatusDelivered {
				mu.Lock()
				got++
				if got == want {
					close(done)
				}
				mu.Unlock()
			}
		}}, outbox.Publisher{Topic: topic, Publish: func(context.Context, outbox.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Start(bg); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Errorf("only %d of %d events delivered in a minute", got, want)
	}
	if err := d.Stop(bg); err != nil {
		t.Fatal(err)
	}
}
