package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// benchTopic is the (namespace, topic) of every event the benchmark writes.
var benchTopic = outbox.Topic{Namespace: "bench", Topic: "events"}

// insertColumns are the columns the library's enqueue statements write;
// the raw-SQL baselines write the same ones.
var insertColumns = []string{"id", "namespace", "topic", "tenant_id", "dedupe_key", "payload", "status", "attempts"}

// eventSource makes events of the one shape all workloads use: a tenant, a
// dedupe key "<tenant id>/<run>/<seq>" (so the dedupe index is maintained
// as in real use) and a JSON payload of about the configured size.
type eventSource struct {
	tenant    uuid.UUID
	tenantKey string
	pad       string
}

func newEventSource(payloadSize int) *eventSource {
	tenant := uuid.New()
	// {"seq":1234567,"kind":"usage_snapshot","pad":""} is about 48 bytes.
	return &eventSource{
		tenant:    tenant,
		tenantKey: tenant.String(), // the canonical spelling the database requires
		pad:       strings.Repeat("x", max(0, payloadSize-48)),
	}
}

func (s *eventSource) payload(seq int64) string {
	return `{"seq":` + strconv.FormatInt(seq, 10) + `,"kind":"usage_snapshot","pad":"` + s.pad + `"}`
}

func (s *eventSource) key(run string, seq int64) string {
	return s.tenantKey + "/" + run + "/" + strconv.FormatInt(seq, 10)
}

// message is event seq of run, for the library.
func (s *eventSource) message(run string, seq int64) outbox.Message {
	return outbox.Message{
		Namespace: benchTopic.Namespace, Topic: benchTopic.Topic,
		TenantID:  outbox.Tenant(s.tenant),
		DedupeKey: outbox.Key(s.key(run, seq)),
		Payload:   []byte(s.payload(seq)),
	}
}

// rawValues are m's values in insertColumns order, with a fresh time-ordered
// id as the library would give it.
func rawValues(m outbox.Message) ([]any, error) {
	id, err := uuid.NewV7()
	if err != nil {
		return nil, err
	}
	// pgtype.UUID is encoded in binary; uuid.UUID would go through its
	// text form, several times slower.
	return []any{pgtype.UUID{Bytes: id, Valid: true}, m.Namespace, m.Topic, pgtype.UUID{Bytes: *m.TenantID, Valid: true},
		*m.DedupeKey, string(m.Payload), "pending", 0}, nil
}

// preloadPending writes n pending, due events with COPY, in transactions of
// preloadChunk rows. created_at increases by a microsecond per event, like
// a steady stream of enqueues; ids are time-ordered (UUIDv7) like the
// library's.
func (t *target) preloadPending(ctx context.Context, src *eventSource, run string, n int) error {
	const preloadChunk = 20000
	cols := append(insertColumns[:len(insertColumns):len(insertColumns)], "created_at", "next_attempt_at")
	base := time.Now().Add(-time.Minute)
	rows := make([][]any, 0, preloadChunk)
	for start := 0; start < n; start += preloadChunk {
		rows = rows[:0]
		for i := start; i < min(n, start+preloadChunk); i++ {
			v, err := rawValues(src.message(run, int64(i)))
			if err != nil {
				return err
			}
			at := base.Add(time.Duration(i) * time.Microsecond)
			rows = append(rows, append(v, at, at))
		}
		if _, err := t.admin.CopyFrom(ctx, t.table, cols, pgx.CopyFromRows(rows)); err != nil {
			return fmt.Errorf("preload: %w", err)
		}
	}
	return nil
}

// insertDelivered adds n delivered events of a day ago, as a table that
// keeps its history (the default retention is 7 days) would hold, with one
// INSERT … SELECT generate_series per chunk. Ids are UUIDv7-shaped (the
// millisecond timestamp first), so they sort like the library's.
func (t *target) insertDelivered(ctx context.Context, src *eventSource, n int) error {
	const chunk = 250000
	stmt := `INSERT INTO ` + t.table.Sanitize() + ` (` + strings.Join(insertColumns, ", ") + `,
	next_attempt_at, created_at, updated_at)
SELECT (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
	$1, $2, $3, $4 || g, $5::jsonb, 'delivered', 1, ts, ts, ts + interval '1 second'
FROM generate_series($6::bigint, $7::bigint) AS g,
	LATERAL (SELECT now() - interval '1 day' + g * interval '10 milliseconds' AS ts, md5(g::text) AS h) AS x`
	for start := 0; start < n; start += chunk {
		end := min(n, start+chunk) - 1
		if _, err := t.admin.Exec(ctx, stmt, benchTopic.Namespace, benchTopic.Topic, src.tenant,
			strings.TrimSuffix(src.historyKeys(), "%"), src.payload(0), start, end); err != nil {
			return fmt.Errorf("insert delivered history: %w", err)
		}
	}
	return nil
}

// historyKeys is the LIKE pattern of the dedupe keys of the rows
// insertDelivered writes (which it builds from the same prefix).
func (s *eventSource) historyKeys() string { return s.tenantKey + "/history/%" }

// deleteAllButHistory empties the table but for the delivered history that
// insertDelivered wrote, and the maintenance leases with it, so that the
// next phase finds the same history without inserting it again. The rows
// deleted leave dead tuples for the next VACUUM, as a purge would.
func (t *target) deleteAllButHistory(ctx context.Context, src *eventSource) error {
	if _, err := t.admin.Exec(ctx, "DELETE FROM "+t.table.Sanitize()+" WHERE NOT coalesce(dedupe_key LIKE $1, false)", src.historyKeys()); err != nil {
		return fmt.Errorf("delete all but the history: %w", err)
	}
	_, err := t.admin.Exec(ctx, "DELETE FROM "+t.leaders.Sanitize())
	return err
}
