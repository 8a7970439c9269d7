package outbox

import (
	"encoding/binary"
	"fmt"

	"github.com/google/uuid"
)

// randomTailBits are a UUIDv7's random bits after its variant, its last 62.
const randomTailBits = 62

// newEventIDs returns n time-ordered event ids (UUIDv7), in increasing
// order. The first comes from uuid.NewV7; the others count up from it in
// its random bits, the "monotonic random" method of RFC 9562 (section
// 6.2, method 2), so a batch costs one id's randomness and clock reading
// instead of n (a seventh of EnqueueBatch's own CPU went to uuid.NewV7:
// BENCHMARKS.md, "Bulk: one pass over each payload"). The ids of a
// batch share their first id's millisecond and sub-millisecond sequence,
// which the next uuid.NewV7 of the process exceeds, so ids stay
// increasing within the process; the 62 random bits of the first keep
// them unique across processes.
func newEventIDs(n int) ([]uuid.UUID, error) {
	first, err := uuid.NewV7()
	if err != nil {
		return nil, fmt.Errorf("outbox: new event id: %w", err)
	}
	if ids := countUp(first, n); ids != nil {
		return ids, nil
	}
	ids := make([]uuid.UUID, n) // counting up would reach the variant bits (p ≈ n/2⁶²): draw each id
	for i := range ids {
		if ids[i], err = uuid.NewV7(); err != nil {
			return nil, fmt.Errorf("outbox: new event id: %w", err)
		}
	}
	return ids, nil
}

// countUp returns first and the n-1 ids after it in first's random bits,
// or nil when they would run past them.
func countUp(first uuid.UUID, n int) []uuid.UUID {
	const mask = 1<<randomTailBits - 1
	tail := binary.BigEndian.Uint64(first[8:])
	if n < 1 || tail&mask > mask-uint64(n-1) {
		return nil
	}
	ids := make([]uuid.UUID, n)
	for i := range ids {
		ids[i] = first
		binary.BigEndian.PutUint64(ids[i][8:], tail+uint64(i))
	}
	return ids
}
