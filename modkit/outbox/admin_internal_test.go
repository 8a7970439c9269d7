package outbox

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// Stats and Backlog list topics by their names' bytes, as Series does,
// whatever order the database's collation gave the rows in (ICU's en-US
// sorts "billing_us" before "billing-eu", bytes after).
func TestStatsSortsTopicsByBytes(t *testing.T) {
	rows := []driver.StatsRow{ // as ICU's en-US collation orders them
		{Namespace: "billing_us", Topic: "t", Status: string(StatusPending), Count: 1},
		{Namespace: "billing-eu", Topic: "t", Status: string(StatusPending), Count: 1},
		{Namespace: "billing-eu", Topic: "t", Status: string(StatusDead), Count: 2},
		{Namespace: "a", Topic: "t_b", Status: string(StatusPending), Count: 1},
		{Namespace: "a", Topic: "t-b", Status: string(StatusPending), Count: 1},
	}
	var got []Topic
	st := statsFrom(rows)
	for _, ts := range st.Topics {
		got = append(got, ts.Topic)
	}
	want := []Topic{{"a", "t-b"}, {"a", "t_b"}, {"billing-eu", "t"}, {"billing_us", "t"}}
	if !slices.Equal(got, want) {
		t.Fatalf("topics in the order %v; want %v", got, want)
	}
	if eu := st.Topics[2]; eu.Pending != 1 || eu.Dead != 2 || st.Total.Pending != 4 || st.Total.Dead != 2 {
		t.Fatalf("counts: %+v, total %+v", eu, st.Total)
	}
}

// Stats and series print with their counts, in fmt and in slog's text
// handler (which uses fmt): the embedded Topic's String method made every
// TopicStats print as its topic alone, and a total as "/".
func TestStatsPrintTheirCounts(t *testing.T) {
	s := Stats{
		Topics: []TopicStats{{Topic: Topic{"shop", "orders"}, Pending: 3, Delivered: 10, Dead: 1, OldestDueAge: 2 * time.Second}},
		Total:  TopicStats{Pending: 3, Delivered: 10, Dead: 1, OldestDueAge: 2 * time.Second},
	}
	got := fmt.Sprintf("%+v", s)
	for _, want := range []string{"shop/orders: 3 pending, 0 processing, 10 delivered, 1 dead, oldest due 2s",
		"all topics: 3 pending, 0 processing, 10 delivered, 1 dead, oldest due 2s"} {
		if !strings.Contains(got, want) {
			t.Errorf("Stats printed as %q, without %q", got, want)
		}
	}
	series := TopicSeries{Topic: Topic{"shop", "orders"}, Points: make([]SeriesPoint, 60), Delivered: 120}
	if got, want := fmt.Sprint(series), "shop/orders: 120 delivered in 60 points"; got != want {
		t.Errorf("TopicSeries printed as %q, want %q", got, want)
	}
}
