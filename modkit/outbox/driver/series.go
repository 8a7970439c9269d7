package driver

import (
	"time"

	"github.com/google/uuid"
)

// SeriesParams asks Store.Series for the delivered events of the last
// Window, counted per Bucket.
type SeriesParams struct {
	// Window ends at the store's clock and starts Window earlier, rounded
	// down to a multiple of Bucket since the Unix epoch.
	Window time.Duration
	// Bucket is the width of one point. Positive.
	Bucket time.Duration
}

// SeriesResult is Store.Series' answer.
type SeriesResult struct {
	// Now is the store's clock when it read the rows (the end of the
	// window).
	Now time.Time
	// Rows holds one row per (topic, bucket) with deliveries, and one per
	// bucket for all topics together (Namespace and Topic empty). Buckets
	// without deliveries have no row.
	Rows []SeriesRow
}

// SeriesRow counts one bucket's deliveries of one topic, or of all topics
// when Namespace and Topic are empty.
type SeriesRow struct {
	Namespace, Topic string
	// Start of the bucket.
	Start time.Time
	// Delivered is how many events reached delivered in the bucket (by
	// updated_at, the time of the outcome).
	Delivered int64
	// Latency quantiles of created_at → updated_at over those events.
	LatencyP50, LatencyP95, LatencyMax time.Duration
}

// SettledParams selects recently settled events for Store.Settled.
type SettledParams struct {
	// Since bounds updated_at (inclusive).
	Since time.Time
	// After is the keyset cursor: rows after (AfterUpdatedAt, AfterID),
	// in the order of the result. A zero AfterUpdatedAt means no cursor.
	AfterUpdatedAt time.Time
	AfterID        uuid.UUID
	// Limit caps the rows returned. Positive.
	Limit int
}
