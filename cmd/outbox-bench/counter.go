package main

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// queryKind classifies the statements a dispatcher sends.
type queryKind int

const (
	kindClaim queryKind = iota
	kindComplete
	kindSweep
	kindPurge
	kindDepth
	kindMaintenance
	kindListen
	kindOther
	numKinds
)

var kindNames = [numKinds]string{"claim", "complete", "sweep", "purge", "depth", "maintenance", "listen", "other"}

// classify tells the dispatcher's statements apart by their text. The
// patterns follow the statements of modkit/outbox/outboxpg/queries.go;
// anything unrecognised is "other". "maintenance" is the election (and
// resignation) of the maintenance lease on the leaders table, which each
// dispatcher runs once per SweepInterval before it sweeps, purges and
// reads the depth gauges of the topics it was elected for. It is tested
// first: resigning is a DELETE FROM like the purge.
func classify(sql string) queryKind {
	switch {
	case strings.HasPrefix(sql, "LISTEN"):
		return kindListen
	case strings.Contains(sql, outboxpg.LeadersTableName), strings.Contains(sql, "modkit_outbox_elect("), strings.Contains(sql, "modkit_outbox_resign("):
		return kindMaintenance
	case strings.Contains(sql, "lease_token = gen_random_uuid()"), strings.Contains(sql, "modkit_outbox_claim(") || strings.Contains(sql, "modkit_outbox_claim_chained("):
		return kindClaim
	case strings.Contains(sql, "AS a(id, token, outcome"), strings.Contains(sql, "modkit_outbox_complete("):
		return kindComplete
	case strings.Contains(sql, "modkit_outbox_sweep("):
		return kindSweep
	case strings.Contains(sql, "modkit_outbox_purge("), strings.Contains(sql, "modkit_outbox_purge_from("):
		return kindPurge
	case strings.Contains(sql, "modkit_outbox_depth("):
		return kindDepth
	}
	return kindOther
}

// queryCounter is a pgx.QueryTracer that counts the statements of every
// connection built from the pool configuration it is set on. The
// dispatcher's LISTEN connection is opened from a copy of that
// configuration, so it is counted too. Pings, which pgxpool sends below the
// tracer's level, are counted through the pool's ShouldPing hook (see
// target.newPoolConfig).
type queryCounter struct {
	byKind [numKinds]atomic.Int64
	pings  atomic.Int64
}

var _ pgx.QueryTracer = (*queryCounter)(nil)

// TraceQueryStart counts one statement.
func (q *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	q.byKind[classify(data.SQL)].Add(1)
	return ctx
}

// TraceQueryEnd does nothing.
func (q *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// counts is a snapshot of a queryCounter.
type counts struct {
	byKind [numKinds]int64
	pings  int64
}

func (q *queryCounter) snapshot() counts {
	var c counts
	for k := range numKinds {
		c.byKind[k] = q.byKind[k].Load()
	}
	c.pings = q.pings.Load()
	return c
}

// sub returns c minus earlier.
func (c counts) sub(earlier counts) counts {
	for k := range numKinds {
		c.byKind[k] -= earlier.byKind[k]
	}
	c.pings -= earlier.pings
	return c
}

// statements is the number of statements, pings excluded.
func (c counts) statements() int64 {
	var n int64
	for _, v := range c.byKind {
		n += v
	}
	return n
}

// breakdown lists the non-zero counts, e.g. "claim 10, sweep 1, ping 10".
func (c counts) breakdown() string { return c.scaled(1) }

// scaled is breakdown with every count multiplied by factor, shown with
// one decimal when factor is not 1.
func (c counts) scaled(factor float64) string {
	format := func(v int64) string {
		if factor == 1 {
			return itoa(v)
		}
		return strconv.FormatFloat(float64(v)*factor, 'f', 1, 64)
	}
	var parts []string
	for k := range numKinds {
		if c.byKind[k] > 0 {
			parts = append(parts, kindNames[k]+" "+format(c.byKind[k]))
		}
	}
	if c.pings > 0 {
		parts = append(parts, "ping "+format(c.pings))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// claimTimer is a pgx.QueryTracer that records how long each claim
// statement took, from sending it to reading its last row.
type claimTimer struct {
	mu    sync.Mutex
	taken []time.Duration
}

type claimStartKey struct{}

// TraceQueryStart notes when a claim started.
func (c *claimTimer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if classify(data.SQL) != kindClaim {
		return ctx
	}
	return context.WithValue(ctx, claimStartKey{}, time.Now())
}

// TraceQueryEnd records a claim's duration.
func (c *claimTimer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if start, ok := ctx.Value(claimStartKey{}).(time.Time); ok {
		c.mu.Lock()
		c.taken = append(c.taken, time.Since(start))
		c.mu.Unlock()
	}
}

func (c *claimTimer) durations() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.taken)
}
