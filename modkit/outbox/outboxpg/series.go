package outboxpg

import (
	"context"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// The operator statements behind Admin.Series and Admin.Settled. They read
// delivered history, which no index of the outbox table covers: they scan
// the table and are meant for dashboards refreshing every few seconds, not
// for tight loops. $1 (Series) and $3 (Settled) are the clock: the test
// clock, or NULL for the database's.
const (
	// Buckets are aligned on the Unix epoch so that two readers agree on
	// them; the grouping sets give every topic's buckets and the totals in
	// one scan.
	qSeries = `WITH w AS (
	SELECT coalesce($1::timestamptz, now()) AS now,
		date_bin($3::interval, coalesce($1::timestamptz, now()) - $2::interval, timestamptz 'epoch') AS start
)
SELECT w.now, e.namespace, e.topic, date_bin($3::interval, e.updated_at, timestamptz 'epoch') AS bucket,
	count(*),
	percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
	percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM e.updated_at - e.created_at))::float8,
	max(extract(epoch FROM e.updated_at - e.created_at))::float8
FROM {{events}} e CROSS JOIN w
WHERE e.status = 'delivered' AND e.updated_at >= w.start AND e.updated_at <= w.now
GROUP BY GROUPING SETS ((w.now, bucket), (w.now, e.namespace, e.topic, bucket))
ORDER BY bucket, e.namespace NULLS FIRST, e.topic NULLS FIRST`

	qNow = `SELECT coalesce($1::timestamptz, now())`

	qSettled = `SELECT ` + eventColumns + ` FROM {{events}}
WHERE status IN ('delivered', 'dead') AND updated_at >= $1 AND updated_at <= coalesce($3::timestamptz, now())
ORDER BY updated_at, id
LIMIT $2`
)

func (s *store) bindOps(q string) string {
	return strings.ReplaceAll(q, "{{events}}", pgx.Identifier{s.opts.Schema, TableName}.Sanitize())
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
	rows, err := s.pool.Query(ctx, s.bindOps(qSettled), p.Since, p.Limit, s.clock())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []driver.Event
	for rows.Next() {
		e, err := scanEvent(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, rows.Err()
}
