package outboxtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"reflect"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/internal/dedupekey"
)

// Matcher narrows the events an assertion considers. Build one with
// Payload, PayloadJSON, PayloadWhere, DedupeKey, Tenant, OrderingKey or
// Header; an assertion given several requires all of them.
type Matcher struct {
	desc string
	// match says whether an event matches; why, when not empty, says that
	// it cannot tell (the payload is hidden from the client's role, or
	// does not decode as the matcher needs).
	match func(outbox.Event) (ok bool, why string)
	// bad says why the matcher cannot match anything (its JSON does not
	// parse or encode); every assertion given it fails at once.
	bad string
}

// String describes the matcher, as failure messages show it.
func (m Matcher) String() string { return m.desc }

// payloadHidden is why a payload matcher cannot judge an event whose
// payload the client may not read.
const payloadHidden = "its payload is hidden from the client's database role (modkit_outbox_reader may not read payloads: " +
	"assert with a client of the operator role or of the tables' owner)"

// Payload matches events whose payload is the JSON encoding of want,
// compared as JSON values (key order, spacing and number spelling do not
// matter). JSON text goes to PayloadJSON (or in a json.RawMessage): a
// string (or a pointer to one, or a type defined as one) that holds a JSON
// object or array, and a byte slice other than a json.RawMessage, which
// encodes as a base64 string, are refused, since they would match no such
// payload and RequireNotEnqueued would pass whatever was enqueued.
func Payload(want any) Matcher {
	refuse := func(why string) Matcher {
		desc := fmt.Sprintf("payload %#v", want)
		if v := reflect.ValueOf(want); v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8 {
			desc = fmt.Sprintf("payload %T(%q)", want, v.Bytes()) // as text, not hex
		}
		return Matcher{desc: desc, bad: why, match: func(outbox.Event) (bool, string) { return false, "" }}
	}
	if _, marshals := want.(json.Marshaler); !marshals {
		v := reflect.ValueOf(want)
		for v.Kind() == reflect.Pointer && !v.IsNil() {
			v = v.Elem()
		}
		switch {
		case v.Kind() == reflect.String && isJSONContainer(v.String()):
			return refuse("a string holding a JSON object or array matches a JSON string payload only; compare JSON text with PayloadJSON")
		case v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8:
			return refuse("a byte slice encodes as a base64 string; compare JSON text with PayloadJSON or pass a json.RawMessage")
		}
	}
	raw, err := json.Marshal(want)
	if err != nil {
		return refuse(fmt.Sprintf("it cannot be encoded as JSON: %v", err))
	}
	return payloadJSON(raw)
}

// isJSONContainer reports whether s is a JSON object or array.
func isJSONContainer(s string) bool {
	t := strings.TrimSpace(s)
	return (strings.HasPrefix(t, "{") || strings.HasPrefix(t, "[")) && json.Valid([]byte(t))
}

// PayloadJSON matches events whose payload equals the JSON document want,
// compared as JSON values.
func PayloadJSON(want string) Matcher { return payloadJSON([]byte(want)) }

func payloadJSON(want []byte) Matcher {
	w, err := decodeJSON(want)
	desc := "payload " + string(want)
	if err != nil {
		return Matcher{desc: desc, bad: "not valid JSON: " + err.Error(), match: func(outbox.Event) (bool, string) { return false, "" }}
	}
	return Matcher{desc: desc, match: func(e outbox.Event) (bool, string) {
		if e.Payload == nil {
			return false, payloadHidden
		}
		got, err := decodeJSON(e.Payload)
		if err != nil {
			return false, "its payload is not JSON: " + err.Error()
		}
		return reflect.DeepEqual(got, w), ""
	}}
}

// decodeJSON decodes one JSON document, and nothing after it.
func decodeJSON(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("more after the JSON value at offset %d (two values, or a stray character?)", dec.InputOffset())
	}
	return normaliseNumbers(v), nil
}

// exactNumber is a JSON number that int64 cannot hold, in big.Rat's exact
// form: a type of its own, so that it never equals a JSON string.
type exactNumber string

// normaliseNumbers rewrites json.Numbers in a canonical form, exact as
// jsonb's numeric is, so that 1.0, 1 and 1e0 compare equal and
// 18446744073709551615 and 18446744073709551614 do not.
func normaliseNumbers(v any) any {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i
		}
		if r, ok := new(big.Rat).SetString(x.String()); ok {
			if r.IsInt() && r.Num().IsInt64() {
				return r.Num().Int64()
			}
			return exactNumber(r.RatString())
		}
		return exactNumber(x.String())
	case []any:
		for i := range x {
			x[i] = normaliseNumbers(x[i])
		}
	case map[string]any:
		for k := range x {
			x[k] = normaliseNumbers(x[k])
		}
	}
	return v
}

// PayloadWhere matches events whose payload decodes (encoding/json) into a
// T for which f returns true. desc says what it checks, for failure
// messages. A payload that does not decode into a T fails the assertion
// (unless another matcher already rules the event out): RequireNotEnqueued
// could not tell whether it is the event it must not find. Decoding is
// encoding/json's: a payload without T's fields, or with others, decodes
// into a T all the same (its fields zero), so f should check the fields it
// relies on.
func PayloadWhere[T any](desc string, f func(T) bool) Matcher {
	return Matcher{desc: desc, match: func(e outbox.Event) (bool, string) {
		if e.Payload == nil {
			return false, payloadHidden
		}
		var v T
		if err := json.Unmarshal(e.Payload, &v); err != nil {
			return false, fmt.Sprintf("its payload does not decode into a %T: %v", v, err)
		}
		return f(v), ""
	}}
}

// DedupeKey matches events with that dedupe key, compared as stored: a
// tenant prefix in any of its spellings (32 hex digits or hyphenated, any
// case) matches, as it finds the same row.
func DedupeKey(key string) Matcher {
	stored := dedupekey.Stored(key)
	return Matcher{desc: fmt.Sprintf("dedupe key %q", key), match: func(e outbox.Event) (bool, string) {
		return e.DedupeKey != nil && *e.DedupeKey == stored, ""
	}}
}

// Tenant matches events of that tenant.
func Tenant(id uuid.UUID) Matcher {
	return Matcher{desc: "tenant " + id.String(), match: func(e outbox.Event) (bool, string) {
		return e.TenantID != nil && *e.TenantID == id, ""
	}}
}

// OrderingKey matches events with that ordering key; "" matches events
// without one. Events of one key come back oldest first, so their Sequence
// fields show the order they will be published in.
func OrderingKey(key string) Matcher {
	desc := fmt.Sprintf("ordering key %q", key)
	if key == "" {
		desc = "no ordering key"
	}
	return Matcher{desc: desc, match: func(e outbox.Event) (bool, string) {
		return e.OrderingKey == key, ""
	}}
}

// Header matches events whose header name has the value value. Like the
// payload matchers, it cannot judge an event whose headers are hidden
// from the client's database role (the reader role's), and fails the
// assertion then.
func Header(name, value string) Matcher {
	return Matcher{desc: fmt.Sprintf("header %s: %q", name, value), match: func(e outbox.Event) (bool, string) {
		if e.Payload == nil { // never NULL in the table: hidden, and the headers with it
			return false, strings.Replace(payloadHidden, "its payload is hidden", "its headers are hidden", 1)
		}
		v, ok := e.Headers[name]
		return ok && v == value, ""
	}}
}

// RequireEnqueued fails t unless at least one committed event of topic
// matches every matcher, and returns the matching events, oldest first.
// Events count whatever their status: a dispatcher may already have
// delivered them (but not deleted them: under Publisher.DeleteOnDelivery
// a delivered event is gone from the table).
func RequireEnqueued(t TB, c *outbox.Client, topic outbox.Topic, match ...Matcher) []outbox.Event {
	t.Helper()
	return requireEnqueued(t, c, topic, match, func() ([]outbox.Event, error) { return committedEvents(c, topic) })
}

// RequireEnqueuedOnce fails t unless exactly one committed event of topic
// matches every matcher, and returns it: RequireEnqueued passes as well
// when a bug enqueued the event twice.
func RequireEnqueuedOnce(t TB, c *outbox.Client, topic outbox.Topic, match ...Matcher) outbox.Event {
	t.Helper()
	return requireOnce(t, topic, match, RequireEnqueued(t, c, topic, match...))
}

// RequireEnqueuedOnceTx is RequireEnqueuedOnce seen from inside tx, the
// caller's transaction (or connection).
func RequireEnqueuedOnceTx(t TB, c *outbox.Client, tx db.Runner, topic outbox.Topic, match ...Matcher) outbox.Event {
	t.Helper()
	return requireOnce(t, topic, match, RequireEnqueuedTx(t, c, tx, topic, match...))
}

func requireOnce(t TB, topic outbox.Topic, match []Matcher, found []outbox.Event) outbox.Event {
	t.Helper()
	switch len(found) {
	case 0: // RequireEnqueued failed t
		return outbox.Event{}
	case 1:
		return found[0]
	}
	fatal(t, "%d events of %s were enqueued%s; want exactly one:%s", len(found), topic, describe(match), summary(found))
	return outbox.Event{}
}

// RequireEnqueuedTx is RequireEnqueued seen from inside tx, the caller's
// transaction (or connection): it also sees the events tx enqueued and has
// not committed yet.
func RequireEnqueuedTx(t TB, c *outbox.Client, tx db.Runner, topic outbox.Topic, match ...Matcher) []outbox.Event {
	t.Helper()
	return requireEnqueued(t, c, topic, match, func() ([]outbox.Event, error) { return eventsTx(c, tx, topic) })
}

// RequireNotEnqueued fails t if a committed event of topic matches every
// matcher (with no matcher: if the topic has any event).
func RequireNotEnqueued(t TB, c *outbox.Client, topic outbox.Topic, match ...Matcher) {
	t.Helper()
	requireNotEnqueued(t, c, topic, match, func() ([]outbox.Event, error) { return committedEvents(c, topic) })
}

// RequireNotEnqueuedTx is RequireNotEnqueued seen from inside tx, the
// caller's transaction (or connection).
func RequireNotEnqueuedTx(t TB, c *outbox.Client, tx db.Runner, topic outbox.Topic, match ...Matcher) {
	t.Helper()
	requireNotEnqueued(t, c, topic, match, func() ([]outbox.Event, error) { return eventsTx(c, tx, topic) })
}

// checkClient fails t for a nil client, which every helper would
// dereference (a panic that ends the whole test binary).
func checkClient(t TB, c *outbox.Client) {
	t.Helper()
	if c == nil {
		fatal(t, "the *outbox.Client is nil: pass the client the code under test enqueues through (outboxtest.NewClient returns one)")
	}
}

// checkTopic fails t for a topic without a namespace or a topic, what
// names it in the message. Events are listed by namespace and topic, an
// empty one standing for any: the zero Topic (what an uninitialised
// TypedTopic's Topic() returns) would match every event, so RequireEnqueued
// would pass on another topic's events and RequireNotEnqueuedTx on none.
func checkTopic(t TB, what string, topic outbox.Topic) {
	t.Helper()
	const pass = "pass the topic the events are enqueued to, with both set, " +
		`such as outbox.Topic{Namespace: "shop", Topic: "order_placed"} or the Topic() of a TypedTopic made with outbox.NewTypedTopic`
	switch {
	case topic == (outbox.Topic{}):
		fatal(t, "%s is the zero outbox.Topic, with no namespace and no topic (an uninitialised TypedTopic, perhaps): %s", what, pass)
	case topic.Namespace == "":
		fatal(t, "%s %q has an empty namespace: %s", what, topic.String(), pass)
	case topic.Topic == "":
		fatal(t, "%s %q has an empty topic (it would match every topic of namespace %q): %s", what, topic.String(), topic.Namespace, pass)
	}
}

// checkMatchers fails t at once for a matcher that cannot match anything:
// RequireNotEnqueued would pass whatever was enqueued, and RequireEnqueued
// would blame the code under test for the test's typo.
func checkMatchers(t TB, match []Matcher) {
	t.Helper()
	for i, m := range match {
		if m.match == nil {
			fatal(t, "matcher %d is the zero outboxtest.Matcher, which matches nothing: build it with Payload, PayloadJSON, "+
				"PayloadWhere, DedupeKey, Tenant, OrderingKey or Header", i)
		}
		if m.bad != "" {
			fatal(t, "matcher %s: %s", m.desc, m.bad)
		}
	}
}

func requireEnqueued(t TB, c *outbox.Client, topic outbox.Topic, match []Matcher, load func() ([]outbox.Event, error)) []outbox.Event {
	t.Helper()
	checkClient(t, c)
	checkTopic(t, "topic", topic)
	checkMatchers(t, match)
	all, err := load()
	if err != nil {
		fatal(t, "list events of %s: %v", topic, err)
	}
	found, unsure := filter(all, match)
	if len(found) == 0 {
		if len(all) == 0 {
			fatal(t, "no event of %s was enqueued%s (the topic has none)", topic, describe(match))
		}
		fatal(t, "no event of %s was enqueued%s; the topic has %d other event(s):%s%s", topic, describe(match), len(all), summary(all),
			unsure.String())
	}
	return found
}

func requireNotEnqueued(t TB, c *outbox.Client, topic outbox.Topic, match []Matcher, load func() ([]outbox.Event, error)) {
	t.Helper()
	checkClient(t, c)
	checkTopic(t, "topic", topic)
	checkMatchers(t, match)
	all, err := load()
	if err != nil {
		fatal(t, "list events of %s: %v", topic, err)
	}
	found, unsure := filter(all, match)
	if len(found) > 0 {
		fatal(t, "%d event(s) of %s were enqueued%s, want none:%s", len(found), topic, describe(match), summary(found))
	}
	if len(unsure) > 0 {
		fatal(t, "cannot tell whether an event of %s was enqueued%s:%s", topic, describe(match), unsure.String())
	}
}

// undecided lists the events a matcher could not judge, and why.
type undecided []string

func (u undecided) String() string {
	if len(u) == 0 {
		return ""
	}
	return "\nevents no matcher ruled out but one could not judge:\n  " + strings.Join(u, "\n  ")
}

// filter returns the events every matcher matches, and the events that no
// matcher ruled out but one could not judge.
func filter(events []outbox.Event, match []Matcher) (found []outbox.Event, unsure undecided) {
next:
	for _, e := range events {
		var why string
		for _, m := range match {
			ok, cannot := m.match(e)
			switch {
			case cannot != "":
				why = fmt.Sprintf("%s: %s: %s", e.ID, m.desc, cannot)
			case !ok:
				continue next
			}
		}
		if why != "" {
			unsure = append(unsure, why)
			continue
		}
		found = append(found, e)
	}
	return found, unsure
}

// committedEvents lists every event of topic through the client's Admin.
func committedEvents(c *outbox.Client, topic outbox.Topic) ([]outbox.Event, error) {
	ctx := context.Background()
	var out []outbox.Event
	f := outbox.EventFilter{Namespace: topic.Namespace, Topic: topic.Topic, Limit: 1000}
	for {
		page, err := c.Admin().List(ctx, f)
		if err != nil {
			return nil, err
		}
		out = append(out, page.Events...)
		if page.NextPage == "" {
			return out, nil
		}
		f.After = page.NextPage
	}
}

// eventsTx lists every event of topic through tx. The outbox's Admin reads
// on its own connections, so this one query is written here, against the
// table of the client's schema.
func eventsTx(c *outbox.Client, tx db.Runner, topic outbox.Topic) ([]outbox.Event, error) {
	q, err := db.AsQuerier(tx)
	if err != nil {
		return nil, err
	}
	table := pgx.Identifier{c.Config().Schema, "modkit_outbox_events"}.Sanitize()
	rows, err := q.Query(context.Background(), `SELECT id::text, namespace, topic, tenant_id::text, dedupe_key, payload::text,
	status, attempts, next_attempt_at, locked_by::text, locked_until, last_error, created_at, updated_at,
	headers::text, ordering_key, ordering_seq
FROM `+table+` WHERE namespace = $1 AND topic = $2 ORDER BY created_at, id`, topic.Namespace, topic.Topic)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []outbox.Event
	for rows.Next() {
		var (
			e                    outbox.Event
			id, payload, status  string
			tenant, lockedBy     *string
			lockedUntil          *time.Time
			dedupeKey, lastError *string
			headers, orderingKey *string
			sequence             *int64
		)
		if err := rows.Scan(&id, &e.Namespace, &e.Topic, &tenant, &dedupeKey, &payload, &status, &e.Attempts,
			&e.NextAttemptAt, &lockedBy, &lockedUntil, &lastError, &e.CreatedAt, &e.UpdatedAt,
			&headers, &orderingKey, &sequence); err != nil {
			return nil, err
		}
		if headers != nil {
			if err := json.Unmarshal([]byte(*headers), &e.Headers); err != nil {
				return nil, fmt.Errorf("outboxtest: decode the headers of event %s: %w", id, err)
			}
		}
		if orderingKey != nil && sequence != nil {
			e.OrderingKey, e.Sequence = *orderingKey, *sequence
		}
		if e.ID, err = uuid.Parse(id); err != nil {
			return nil, err
		}
		if e.TenantID, err = parseOptionalUUID(tenant); err != nil {
			return nil, err
		}
		if e.LockedBy, err = parseOptionalUUID(lockedBy); err != nil {
			return nil, err
		}
		e.Payload, e.Status, e.DedupeKey, e.LockedUntil, e.LastError = []byte(payload), outbox.Status(status), dedupeKey, lockedUntil, lastError
		out = append(out, e)
	}
	return out, rows.Err()
}

func parseOptionalUUID(s *string) (*uuid.UUID, error) {
	if s == nil {
		return nil, nil
	}
	id, err := uuid.Parse(*s)
	if err != nil {
		return nil, err
	}
	return &id, nil
}
