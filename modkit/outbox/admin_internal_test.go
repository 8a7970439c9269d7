package outbox

import (
	"slices"
	"testing"

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
