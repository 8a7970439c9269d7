package outbox

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/google/uuid"
)

// A batch's ids are UUIDv7s in increasing order, all distinct, and the
// process's next id comes after them.
func TestNewEventIDsIncrease(t *testing.T) {
	before, err := uuid.NewV7()
	if err != nil {
		t.Fatal(err)
	}
	ids, err := newEventIDs(1000)
	if err != nil {
		t.Fatal(err)
	}
	after, err := uuid.NewV7()
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1000 {
		t.Fatalf("%d ids, want 1000", len(ids))
	}
	prev := before
	for i, id := range append(ids, after) {
		if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
			t.Fatalf("id %d, %s: version %d, variant %s; want a UUIDv7", i, id, id.Version(), id.Variant())
		}
		if bytes.Compare(prev[:], id[:]) >= 0 {
			t.Fatalf("id %d, %s, does not come after %s", i, id, prev)
		}
		prev = id
	}
}

// Counting up stops short of the variant bits: a first id whose random
// tail leaves no room for the batch yields nil (newEventIDs then draws each
// id), one with just enough room fills it exactly.
func TestCountUpStaysInTheRandomBits(t *testing.T) {
	const mask = 1<<randomTailBits - 1
	withTail := func(tail uint64) uuid.UUID {
		id := uuid.Must(uuid.NewV7())
		binary.BigEndian.PutUint64(id[8:], 0b10<<randomTailBits|tail)
		return id
	}
	if ids := countUp(withTail(mask-8), 10); ids != nil {
		t.Fatalf("countUp ran past the random bits: last id %s", ids[len(ids)-1])
	}
	ids := countUp(withTail(mask-9), 10)
	if len(ids) != 10 {
		t.Fatalf("countUp gave %d ids where exactly 10 fit", len(ids))
	}
	if last := ids[9]; last.Variant() != uuid.RFC4122 || binary.BigEndian.Uint64(last[8:])&mask != mask {
		t.Fatalf("last id %s: variant %s, want the highest tail", last, last.Variant())
	}
	if countUp(withTail(0), 0) != nil {
		t.Fatal("countUp of no ids returned some")
	}
}
