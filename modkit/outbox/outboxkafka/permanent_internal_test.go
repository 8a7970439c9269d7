package outboxkafka

import (
	"fmt"
	"testing"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Which "too large" answers are permanent: the client's own refusal of a
// record (no compressed size in its text), and a broker's answer only for
// a record over the client's batch limit. A broker's RECORD_LIST_TOO_LARGE
// answers a whole batch, and a small record in it is retried.
func TestIsPermanentTooLarge(t *testing.T) {
	p := &Publisher{batchMax: 1000}
	small, big := &kgo.Record{Value: make([]byte, 10)}, &kgo.Record{Value: make([]byte, 2000)}
	for _, c := range []struct {
		name string
		err  error
		r    *kgo.Record
		want bool
	}{
		{"the client's refusal", fmt.Errorf("%w (uncompressed_bytes=990)", kerr.MessageTooLarge), small, true},
		{"the broker's, small record", fmt.Errorf("%w (uncompressed_bytes=9000, compressed_bytes=9000)", kerr.MessageTooLarge), small, false},
		{"the broker's, record over the batch limit", fmt.Errorf("%w (uncompressed_bytes=9000, compressed_bytes=9000)", kerr.MessageTooLarge), big, true},
		{"record list, small record", kerr.RecordListTooLarge, small, false},
		{"record list, record over the batch limit", kerr.RecordListTooLarge, big, true},
	} {
		if got := p.isPermanent(c.err, c.r); got != c.want {
			t.Errorf("%s: permanent %v, want %v", c.name, got, c.want)
		}
	}
}
