package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
)

// Instruction is a payment instruction as a participant submits it.
type Instruction struct {
	ID          uuid.UUID
	Participant string
	AmountMinor int64
	Currency    string
	Destination string
}

// Accepted is an accepted instruction: its place among its participant's
// and the id of its event.
type Accepted struct {
	Instruction
	Seq     int64
	EventID uuid.UUID
}

// ErrAlreadyAccepted is returned by Accept for an instruction id accepted
// before: the first acceptance stands (the API role may not read the
// ledger to answer with it).
var ErrAlreadyAccepted = errors.New("payments: instruction already accepted")

// API accepts instructions. It connects as a login role in
// modkit_outbox_producer: it may enqueue, and write its own tables, but
// not read or change any event.
type API struct {
	pool   *pgxpool.Pool
	outbox *outbox.Client
}

// NewAPI returns an API on pool.
func NewAPI(pool *pgxpool.Pool, client *outbox.Client) *API { return &API{pool: pool, outbox: client} }

// Accept stores in and enqueues its payment in one transaction: the
// instruction is accepted with its event or not at all. The event is
// ordered by participant (OrderingKey) and deduplicated by instruction id
// (DedupeKey), which also travels to the rail as the idempotency key.
func (a *API) Accept(ctx context.Context, runID uuid.UUID, in Instruction) (Accepted, error) {
	out := Accepted{Instruction: in}
	err := db.InTx(ctx, a.pool, func(ctx context.Context, tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `UPDATE payments_participants SET next_seq = next_seq + 1
			WHERE id = $1 RETURNING next_seq - 1`, in.Participant).Scan(&out.Seq); err != nil {
			return fmt.Errorf("participant %s: %w", in.Participant, err)
		}
		payload, err := json.Marshal(Payment{InstructionID: in.ID.String(), Participant: in.Participant, Seq: out.Seq,
			AmountMinor: in.AmountMinor, Currency: in.Currency, Destination: in.Destination})
		if err != nil {
			return err
		}
		enq, err := a.outbox.Enqueue(ctx, tx, outbox.Message{
			Namespace: Topic.Namespace, Topic: Topic.Topic,
			DedupeKey: outbox.Key(in.ID.String()), OrderingKey: in.Participant,
			Headers: map[string]string{HeaderIdempotencyKey: in.ID.String()},
			Payload: payload,
		})
		if err != nil {
			return err
		}
		if enq.AlreadyEnqueued {
			// Its dedupe key (the instruction id) found the first
			// acceptance's event: refused, and the sequence number taken
			// above is rolled back with the transaction.
			return fmt.Errorf("%w (its event is %s)", ErrAlreadyAccepted, enq.ID)
		}
		out.EventID = enq.ID
		_, err = tx.Exec(ctx, `INSERT INTO payments_instructions
			(id, run_id, participant_id, seq, amount_minor, currency, destination, event_id)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`,
			in.ID, runID, in.Participant, out.Seq, in.AmountMinor, in.Currency, in.Destination, enq.ID)
		return err
	})
	if err != nil {
		return Accepted{}, fmt.Errorf("accept instruction %s: %w", in.ID, err)
	}
	return out, nil
}
