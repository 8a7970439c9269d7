package outboxpg

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox/driver"
)

// copyMinBatch is the smallest batch Insert tries to COPY.
const copyMinBatch = 64

// copyColumns are the columns the COPY fast path writes (those a producer
// may insert), in the order appendCopyRow encodes them; status, attempts
// and the lease take their defaults.
const copyColumns = "id, namespace, topic, tenant_id, dedupe_key, payload, headers"

// copyColumnNames are copyColumns, for tracers.
var copyColumnNames = strings.Split(copyColumns, ", ")

// copySavepoint is the savepoint that lets a failed COPY inside the
// caller's transaction be undone.
const copySavepoint = "modkit_outbox_copy"

// tryCopy is the batch insert's fast path: COPY, which PostgreSQL writes in
// bulk, about a third faster than the INSERT … SELECT unnest(…) ON CONFLICT
// it replaces. COPY cannot skip a conflicting dedupe key, so it is tried
// optimistically: when a key already exists, or is repeated inside the
// batch, the COPY fails with a unique violation, is undone (in a pgx.Tx by
// a savepoint, so the caller's transaction goes on), and tryCopy reports
// false for the INSERT path to sort the duplicates out. (Looking for
// repeated keys beforehand cost every batch a map of its keys, nearly a
// third of the driver's own CPU in a bulk load, pgx's encoding aside, to
// spare the rare batch that repeats one a failed COPY.) It is used for
// batches of at least copyMinBatch rows without ordering keys, through a
// pgx.Tx whose Conn is not nil or a *pgxpool.Pool; other runners
// (database/sql, bun, *pgx.Conn, which may be inside a transaction the
// driver cannot see, a pgx.Tx wrapper without a connection) always take
// the INSERT path.
//
// The COPY, the announcement of the batch's topics and, in a transaction,
// the savepoint and its release go to the server as one simple-protocol
// query (see copyStatement), and the rows in PostgreSQL's binary COPY
// format, encoded here (copyReader): a batch costs the caller's
// transaction one round trip, as a bare COPY does, where pgx's CopyFrom
// and separate statements took four (BENCHMARKS.md, "Bulk enqueue in one
// round trip" and "The savepoint in the COPY's query"). The connection's
// pgx.CopyFromTracer, if any, sees the COPY as it would see pgx's
// CopyFrom (see copyIn).
func (s *store) tryCopy(ctx context.Context, tx any, rows []driver.InsertRow, notify []string) (bool, error) {
	if len(rows) < copyMinBatch {
		return false, nil
	}
	for i := range rows {
		if rows[i].OrderingKey != nil { // sequences come from the function
			return false, nil
		}
	}
	var err error
	switch r := tx.(type) {
	case pgx.Tx:
		conn := r.Conn()
		if conn == nil { // a wrapper without one: the INSERT path uses its methods
			return false, nil
		}
		// pgx refuses a transaction already committed or rolled back
		// (whose connection may belong to someone else by now); an empty
		// batch asks it without a round trip. The savepoint, the COPY and
		// the rest then go through its connection as one query.
		if err = r.SendBatch(ctx, &pgx.Batch{}).Close(); err != nil {
			return false, insertError(err)
		}
		if err = s.copyIn(ctx, conn, rows, s.copyStatement(true, notify)); isUniqueViolation(err) {
			// A dedupe key exists or repeats: undo the COPY (and the
			// announcement) and leave the caller's transaction usable for
			// the INSERT path, which sorts the duplicates out. Should the
			// rollback fail too (the connection is gone), that path's error
			// says so. Any other failure leaves the transaction aborted, as
			// the INSERT path's (and every other runner's) does: the batch
			// is not in it, and the caller must roll it back.
			_, _ = r.Exec(ctx, "ROLLBACK TO SAVEPOINT "+copySavepoint+"; RELEASE SAVEPOINT "+copySavepoint)
		}
	case *pgxpool.Pool:
		// A transaction of its own: the statements of one simple query
		// commit together.
		err = r.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
			return s.copyIn(ctx, c.Conn(), rows, s.copyStatement(false, notify))
		})
	default:
		return false, nil
	}
	if isUniqueViolation(err) { // a dedupe key exists or repeats: the INSERT path resolves it
		return false, nil
	}
	return err == nil, insertError(err)
}

// isUniqueViolation reports whether err is PostgreSQL's unique_violation.
func isUniqueViolation(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

// copyIn sends rows to conn with the COPY query sql, and reports the COPY
// to conn's pgx.CopyFromTracer, if its Tracer is one, as pgx's CopyFrom
// would: the table, the columns, and on success the tag "COPY n".
func (s *store) copyIn(ctx context.Context, conn *pgx.Conn, rows []driver.InsertRow, sql string) error {
	tracer, _ := conn.Config().Tracer.(pgx.CopyFromTracer)
	if tracer != nil {
		ctx = tracer.TraceCopyFromStart(ctx, conn, pgx.TraceCopyFromStartData{TableName: s.table, ColumnNames: copyColumnNames})
	}
	_, err := conn.PgConn().CopyFrom(ctx, &copyReader{rows: rows}, sql)
	if tracer != nil {
		end := pgx.TraceCopyFromEndData{Err: err}
		if err == nil {
			end.CommandTag = pgconn.NewCommandTag(fmt.Sprintf("COPY %d", len(rows)))
		}
		tracer.TraceCopyFromEnd(ctx, conn, end)
	}
	return err
}

// copyStatement is the simple-protocol query of a COPY batch: inSavepoint,
// the start of copySavepoint; the COPY from the client's binary data; the
// announcement of the topics (nil: none); and, inSavepoint, the release of
// copySavepoint. Statements after a failed one do not run, so a batch that
// fails announces nothing. (Should the savepoint fail, in a transaction
// already aborted, the server ignores the COPY data that follows the
// query, as the protocol has it.)
func (s *store) copyStatement(inSavepoint bool, notify []string) string {
	var b strings.Builder
	if inSavepoint {
		b.WriteString("SAVEPOINT " + copySavepoint + "; ")
	}
	b.WriteString("COPY ")
	b.WriteString(s.table.Sanitize())
	b.WriteString(" (" + copyColumns + ") FROM STDIN (FORMAT binary)")
	if len(notify) > 0 {
		b.WriteString("; SELECT pg_catalog.pg_notify(" + quoteLiteral(NotifyChannel(s.opts.Schema)) + ", t) FROM pg_catalog.unnest(ARRAY[")
		for i, t := range notify {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(quoteLiteral(t))
		}
		b.WriteString("]::text[]) AS t")
	}
	if inSavepoint {
		b.WriteString("; RELEASE SAVEPOINT " + copySavepoint)
	}
	return b.String()
}

// quoteLiteral quotes s as an SQL string literal, whatever the server's
// standard_conforming_strings (as libpq's PQescapeLiteral does).
func quoteLiteral(s string) string {
	q := "'" + strings.ReplaceAll(s, "'", "''") + "'"
	if strings.Contains(s, `\`) {
		q = " E" + strings.ReplaceAll(q, `\`, `\\`)
	}
	return q
}

// copySignature starts PostgreSQL's binary COPY format: the signature,
// flags (none) and the length of the header extension (none).
var copySignature = []byte("PGCOPY\n\xff\r\n\x00\x00\x00\x00\x00\x00\x00\x00\x00")

// copyReader is the COPY's data: rows in PostgreSQL's binary COPY format,
// encoded a chunk at a time as pgconn reads them.
type copyReader struct {
	rows    []driver.InsertRow
	next    int    // the next row to encode
	started bool   // copySignature is encoded
	buf     []byte // encoded data, read up to off
	off     int
	last    bool // buf holds the end of the data
}

// Read implements io.Reader.
func (r *copyReader) Read(p []byte) (int, error) {
	if r.off == len(r.buf) {
		if r.last {
			return 0, io.EOF
		}
		if err := r.fill(len(p)); err != nil {
			return 0, err
		}
	}
	n := copy(p, r.buf[r.off:])
	r.off += n
	return n, nil
}

// fill encodes rows into buf until it holds at least size bytes or the
// rows run out, then the trailer.
func (r *copyReader) fill(size int) error {
	b := r.buf[:0]
	if !r.started {
		b, r.started = append(b, copySignature...), true
	}
	for ; r.next < len(r.rows) && len(b) < size; r.next++ {
		var err error
		if b, err = appendCopyRow(b, &r.rows[r.next]); err != nil {
			return err
		}
	}
	if r.next == len(r.rows) {
		b, r.last = binary.BigEndian.AppendUint16(b, math.MaxUint16), true // a field count of -1 ends the data
	}
	r.buf, r.off = b, 0
	return nil
}

// appendCopyRow appends row's fields, in copyColumns' order, in the binary
// format of their columns' types: each is its length (-1 for NULL) and its
// bytes; a uuid is its 16 bytes, text its UTF-8, jsonb a version byte (1)
// and the JSON text.
func appendCopyRow(b []byte, row *driver.InsertRow) ([]byte, error) {
	b = binary.BigEndian.AppendUint16(b, 7)
	b = appendCopyField(b, row.ID[:])
	b = appendCopyText(b, row.Namespace)
	b = appendCopyText(b, row.Topic)
	if row.TenantID != nil {
		b = appendCopyField(b, row.TenantID[:])
	} else {
		b = appendCopyNull(b)
	}
	if row.DedupeKey != nil {
		b = appendCopyText(b, *row.DedupeKey)
	} else {
		b = appendCopyNull(b)
	}
	if len(row.Payload) >= math.MaxInt32 {
		return nil, fmt.Errorf("outboxpg: payload of %d bytes is too large for COPY", len(row.Payload))
	}
	b = appendCopyJSONB(b, row.Payload)
	if len(row.Headers) == 0 {
		return appendCopyNull(b), nil
	}
	h, err := json.Marshal(row.Headers)
	if err != nil {
		return nil, fmt.Errorf("outboxpg: encode headers: %w", err)
	}
	return appendCopyJSONB(b, h), nil
}

func appendCopyField(b, v []byte) []byte {
	return append(binary.BigEndian.AppendUint32(b, uint32(len(v))), v...)
}

func appendCopyText(b []byte, v string) []byte {
	return append(binary.BigEndian.AppendUint32(b, uint32(len(v))), v...)
}

func appendCopyJSONB(b, v []byte) []byte {
	return append(append(binary.BigEndian.AppendUint32(b, uint32(len(v)+1)), 1), v...)
}

func appendCopyNull(b []byte) []byte { return binary.BigEndian.AppendUint32(b, math.MaxUint32) }
