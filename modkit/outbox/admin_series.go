package outbox

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Limits of Admin.Series, Admin.Settled and Admin.SettledPage.
const (
	seriesWindowDefault = time.Hour
	seriesWindowMax     = 7 * 24 * time.Hour
	seriesBucketDefault = time.Minute
	seriesPointsMax     = 1000
	settledLimitDefault = 100
	settledLimitMax     = 1000
)

// SeriesQuery selects the window of Admin.Series.
type SeriesQuery struct {
	// Window is how far back the series goes. Default one hour, at most
	// seven days.
	Window time.Duration
	// Bucket is the width of one point. Default one minute; Window/Bucket
	// must not exceed 1000. Buckets are aligned to multiples of Bucket, so
	// the series starts at the bucket holding the window's start and ends
	// with the bucket in progress: up to Window/Bucket+1 points, and a
	// Bucket wider than Window gives the one or two buckets that cover it.
	Bucket time.Duration
}

// SeriesPoint is one bucket of deliveries.
type SeriesPoint struct {
	// Start of the bucket; it lasts Series.Bucket.
	Start time.Time
	// Delivered is the number of events that reached delivered in the
	// bucket.
	Delivered int64
	// Latency quantiles, from enqueue (created_at) to the delivered outcome
	// (updated_at), of those events: queueing, retries and publishing
	// together. Zero when Delivered is zero.
	LatencyP50, LatencyP95, LatencyMax time.Duration
}

// TopicSeries is one topic's points. Series.Total's Topic is empty.
type TopicSeries struct {
	Topic
	// Points cover the whole window, one per bucket, oldest first.
	Points []SeriesPoint
	// Delivered is the sum of the points' Delivered.
	Delivered int64
}

// String gives the topic, its deliveries and its points' count, for logs
// and fmt ("shop/orders: 120 delivered in 60 points"). Without it the
// embedded Topic's String would print the topic alone.
func (s TopicSeries) String() string {
	return fmt.Sprintf("%s: %d delivered in %d points", topicOrAll(s.Topic), s.Delivered, len(s.Points))
}

// Series is the delivery history of a window, per topic and in total.
type Series struct {
	// Start and End of the window (End is the database clock's now).
	Start, End time.Time
	// Bucket is the width of every point.
	Bucket time.Duration
	// Total over all topics: one point per bucket, oldest first.
	Total TopicSeries
	// Topics that delivered anything in the window, sorted by namespace,
	// then topic, byte by byte.
	Topics []TopicSeries
}

// Series returns throughput and delivery latency over the last q.Window,
// per topic and in total, from the delivered events still in the table (a
// topic's retention shorter than the window leaves gaps). It reads the
// window's deliveries from the settled index (before migration 0024, every
// delivered event kept), so its cost grows with the deliveries in the
// window: a dashboard may call it every few seconds.
func (a *Admin) Series(ctx context.Context, q SeriesQuery) (Series, error) {
	if q.Window == 0 {
		q.Window = seriesWindowDefault
	}
	if q.Bucket == 0 {
		q.Bucket = seriesBucketDefault
	}
	switch {
	case q.Window < 0 || q.Window > seriesWindowMax:
		return Series{}, configError("SeriesQuery.Window is %v; it must be between 0 and %v", q.Window, seriesWindowMax)
	case q.Bucket < time.Second || q.Bucket%time.Second != 0:
		return Series{}, configError("SeriesQuery.Bucket is %v; use whole seconds, at least 1s", q.Bucket)
	case q.Window/q.Bucket > seriesPointsMax:
		return Series{}, configError("SeriesQuery asks for %d points; widen Bucket so that Window/Bucket is at most %d",
			q.Window/q.Bucket, seriesPointsMax)
	}
	res, err := a.c.store.Series(ctx, driver.SeriesParams{Window: q.Window, Bucket: q.Bucket})
	if err != nil {
		return Series{}, a.wrapErr(err, "series")
	}
	end := res.Now
	start := alignDown(end.Add(-q.Window), q.Bucket)
	n := int(end.Sub(start)/q.Bucket) + 1
	out := Series{Start: start, End: end, Bucket: q.Bucket, Total: newTopicSeries(Topic{}, start, q.Bucket, n)}
	index := map[Topic]int{}
	for _, r := range res.Rows {
		i := int(r.Start.Sub(start) / q.Bucket)
		if i < 0 || i >= n {
			continue
		}
		ts := &out.Total
		if r.Namespace != "" {
			t := Topic{Namespace: r.Namespace, Topic: r.Topic}
			k, ok := index[t]
			if !ok {
				k = len(out.Topics)
				index[t] = k
				out.Topics = append(out.Topics, newTopicSeries(t, start, q.Bucket, n))
			}
			ts = &out.Topics[k]
		}
		p := &ts.Points[i]
		p.Delivered, p.LatencyP50, p.LatencyP95, p.LatencyMax = r.Delivered, r.LatencyP50, r.LatencyP95, r.LatencyMax
		ts.Delivered += r.Delivered
	}
	slices.SortFunc(out.Topics, func(a, b TopicSeries) int { return compareTopics(a.Topic, b.Topic) })
	return out, nil
}

func alignDown(t time.Time, d time.Duration) time.Time {
	return time.Unix(0, t.UnixNano()-t.UnixNano()%int64(d)).In(t.Location())
}

func newTopicSeries(t Topic, start time.Time, bucket time.Duration, n int) TopicSeries {
	ts := TopicSeries{Topic: t, Points: make([]SeriesPoint, n)}
	for i := range ts.Points {
		ts.Points[i].Start = start.Add(time.Duration(i) * bucket)
	}
	return ts
}

// Settled returns the events delivered or dead-lettered at or after since
// (by their last change, updated_at), oldest change first, at most limit
// (default 100, at most 1000). Follow deliveries live by calling it again
// with the UpdatedAt of the last event returned, keeping the ids already
// seen: several events can share a timestamp, and a transaction that
// commits late can record an outcome a little earlier than ones already
// read, so read again a few seconds back. More than limit events sharing
// one timestamp cannot be paged through by time: SettledPage pages by a
// cursor instead. It reads the settled index, from since on (before
// migration 0023, the whole table); a poll every second or so is cheap.
func (a *Admin) Settled(ctx context.Context, since time.Time, limit int) ([]Event, error) {
	if limit == 0 {
		limit = settledLimitDefault
	}
	if limit < 0 || limit > settledLimitMax {
		return nil, configError("Settled limit is %d; it must be between 1 and %d", limit, settledLimitMax)
	}
	rows, err := a.c.store.Settled(ctx, driver.SettledParams{Since: since, Limit: limit})
	if err != nil {
		return nil, a.wrapErr(err, "settled events")
	}
	out := make([]Event, len(rows))
	for i, e := range rows {
		out[i] = eventFrom(e)
	}
	return out, nil
}

// SettledQuery selects the events of Admin.SettledPage.
type SettledQuery struct {
	// Since bounds the time of the outcome (updated_at), inclusive; zero
	// reads from the oldest outcome still in the table.
	Since time.Time
	// Limit is the page size: default 100, at most 1000.
	Limit int
	// After is the NextPage of the previous page; empty for the first.
	// Keep Since as it was for the first page.
	After string
}

// SettledPage returns the events delivered or dead-lettered at or after
// q.Since, oldest outcome first (by updated_at, then id), a page at a time:
// pass each page's NextPage as q.After for the next, until it is empty. No
// event is skipped or returned twice while its outcome stays the same,
// however many share one timestamp. To follow outcomes live, read again
// later from a little before the last UpdatedAt seen, keeping the ids
// already seen (see Settled: a transaction that commits late can record an
// outcome earlier than ones already read). A cursor SettledPage did not
// produce is an error matching ErrInvalidCursor. Like Settled it reads the
// settled index from q.Since on. Pages after the first need migration 0023
// (Migrate, or modkit-outbox migrate up).
func (a *Admin) SettledPage(ctx context.Context, q SettledQuery) (EventPage, error) {
	limit := q.Limit
	if limit == 0 {
		limit = settledLimitDefault
	}
	if limit < 0 || limit > settledLimitMax {
		return EventPage{}, configError("SettledQuery.Limit is %d; it must be between 1 and %d", q.Limit, settledLimitMax)
	}
	p := driver.SettledParams{Since: q.Since, Limit: limit + 1} // one more, to know whether there is a next page
	if q.After != "" {
		at, id, err := decodeSettledCursor(q.After)
		if err != nil {
			return EventPage{}, err
		}
		p.AfterUpdatedAt, p.AfterID = at, id
	}
	rows, err := a.c.store.Settled(ctx, p)
	if err != nil {
		return EventPage{}, a.wrapErr(err, "settled events")
	}
	return pageOf(rows, limit, func(last Event) string { return encodeSettledCursor(last.UpdatedAt, last.ID) }), nil
}
