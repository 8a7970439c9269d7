package outboxpg

import (
	"context"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// The operator statements behind Admin.Series, Admin.Settled and
// Admin.SettledPage. They read delivered history from the settled index
// (settled_status, settled_at), from the start of their window or page on
// (migrations 0023 and 0024; before, the whole table), so their cost grows
// with the outcomes in that window, not with those kept. $1 (Series), $3
// (Settled) and $5 (a settled page after a cursor) are the clock: the test
// clock, or NULL for the database's.
const (
	qSeries = `SELECT at, ns, tp, bucket_start, delivered, latency_p50, latency_p95, latency_max
FROM {{fn}}modkit_outbox_series($2::interval, $3::interval, $1::timestamptz)`

	qNow = `SELECT coalesce($1::timestamptz, now())`

	qSettled         = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_settled($1, $2, $3::timestamptz)`
	qSettledPayloads = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_settled_payloads($1, $2, $3::timestamptz)`

	// After a cursor (migration 0023); without one, the statements above
	// serve, so that a schema not yet migrated to 0023 still answers.
	qSettledAfter         = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_settled_page($1, $2, $3, $4, $5::timestamptz)`
	qSettledAfterPayloads = `SELECT ` + eventColumns + ` FROM {{fn}}modkit_outbox_settled_page_payloads($1, $2, $3, $4, $5::timestamptz)`
)

func (s *store) bindOps(q string) string {
	return strings.ReplaceAll(q, "{{fn}}", pgx.Identifier{s.opts.Schema}.Sanitize()+".")
}

// clock is the test clock, or nil for the database's.
func (s *store) clock() *time.Time {
	if s.opts.Now == nil {
		return nil
	}
	t := s.opts.Now()
	return &t
}

func seconds(f float64) time.Duration { return time.Duration(f * float64(time.Second)) }

// Series implements driver.Store.
func (s *store) Series(ctx context.Context, p driver.SeriesParams) (driver.SeriesResult, error) {
	var res driver.SeriesResult
	now := s.clock()
	rows, err := s.pool.Query(ctx, s.bindOps(qSeries), now, p.Window, p.Bucket)
	if err != nil {
		return res, err
	}
	defer rows.Close()
	for rows.Next() {
		var r driver.SeriesRow
		var ns, topic *string
		var p50, p95, pmax float64
		if err := rows.Scan(&res.Now, &ns, &topic, &r.Start, &r.Delivered, &p50, &p95, &pmax); err != nil {
			return res, err
		}
		if ns != nil && topic != nil {
			r.Namespace, r.Topic = *ns, *topic
		}
		r.LatencyP50, r.LatencyP95, r.LatencyMax = seconds(p50), seconds(p95), seconds(pmax)
		res.Rows = append(res.Rows, r)
	}
	if err := rows.Err(); err != nil {
		return res, err
	}
	if res.Now.IsZero() {
		err = s.pool.QueryRow(ctx, qNow, now).Scan(&res.Now)
	}
	return res, err
}

// Settled implements driver.Store.
func (s *store) Settled(ctx context.Context, p driver.SettledParams) ([]driver.Event, error) {
	return withPayloads(s, func(payloads bool) ([]driver.Event, error) {
		q, args := qSettled, []any{p.Since, p.Limit, s.clock()}
		if payloads {
			q = qSettledPayloads
		}
		if !p.AfterUpdatedAt.IsZero() {
			q, args = qSettledAfter, []any{p.Since, p.AfterUpdatedAt, uuidArg(p.AfterID), p.Limit, s.clock()}
			if payloads {
				q = qSettledAfterPayloads
			}
		}
		rows, err := s.pool.Query(ctx, s.bindOps(q), args...)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, func(r pgx.CollectableRow) (driver.Event, error) { return scanEvent(r) })
	})
}
