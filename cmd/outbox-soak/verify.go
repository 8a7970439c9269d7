package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
)

// report is the outcome of a run.
type report struct {
	elapsed         time.Duration
	seed            uint64
	lease           time.Duration
	generations     int
	logDir          string
	producerRetries int64

	enqueued, healthy, transient, permanent int
	delivered, dead                         int
	deliveries                              int // rows in soak_deliveries
	lateDeliveries                          int // of which made after their lease had ended
	eventsDeliveredTwice, extraDeliveries   int
	byKill, byRestart, unattributed         int           // duplicate deliveries, by cause
	byKillInFlight                          int           // of byKill: written by the server after the process had died
	maxInFlightLag                          time.Duration // the latest such write began this long after the death
	kills, restarts                         int
	audited                                 int
	reenqueued                              int // dedupe keys enqueued as two events
	counts                                  []check
	failures                                []string
}

// check is one verified quantity and whether it had to be zero.
type check struct {
	what string
	n    int
}

func (r *report) fail(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}

// finalEvents is every event with its final status: the rows of the events
// table, and the events deleted on delivery (Publisher.DeleteOnDelivery),
// which only their ledger rows still record.
const finalEvents = `(SELECT e.id, e.status, e.attempts FROM modkit_outbox_events e
	UNION ALL
	SELECT l.event_id, 'delivered', l.attempt FROM modkit_outbox_attempts l
	WHERE l.outcome = 'delivered' AND l.detail = 'deleted on delivery') f`

// verify checks the database after the drain.
func verify(ctx context.Context, pool *pgxpool.Pool, o options, incidents []incident, committed []int64) *report {
	r := &report{lease: o.lease}
	for _, in := range incidents {
		if in.kind == "kill" {
			r.kills++
		} else {
			r.restarts++
		}
	}
	scalar := func(sql string, args ...any) int {
		var n int
		if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			r.fail("query failed: %v\n%s", err, sql)
		}
		return n
	}
	r.enqueued = scalar(`SELECT count(*) FROM soak_enqueued`)
	r.healthy = scalar(`SELECT count(*) FROM soak_enqueued WHERE poison IS NULL`)
	r.transient = scalar(`SELECT count(*) FROM soak_enqueued WHERE poison = 'transient'`)
	r.permanent = scalar(`SELECT count(*) FROM soak_enqueued WHERE poison = 'permanent'`)
	r.delivered = scalar(`SELECT count(*) FROM ` + finalEvents + ` WHERE f.status = 'delivered'`)
	r.dead = scalar(`SELECT count(*) FROM modkit_outbox_events WHERE status = 'dead'`)
	r.deliveries = scalar(`SELECT count(*) FROM soak_deliveries`)
	r.lateDeliveries = scalar(`SELECT count(*) FROM soak_deliveries WHERE lease_token IS NULL`)
	r.audited = scalar(`SELECT count(*) FROM soak_audit`)
	r.reenqueued = scalar(`SELECT count(*) FROM (SELECT seq FROM soak_enqueued GROUP BY seq HAVING count(*) > 1) x`)
	if r.enqueued == 0 || r.deliveries == 0 {
		r.fail("nothing was enqueued or delivered")
	}

	// Each must be zero.
	mustBeZero := []check{
		// The producers' own record, kept outside the database: a commit
		// they saw succeed that a restart lost would take its
		// soak_enqueued row with it, and every check below with it.
		{"commits the producers saw that left no record (lost)", scalar(`SELECT count(*) FROM unnest($1::bigint[]) AS c(seq)
			WHERE NOT EXISTS (SELECT 1 FROM soak_enqueued q WHERE q.seq = c.seq)`, committed)},
		{"settled events changed afterwards", scalar(`SELECT count(*) FROM soak_resettled`)},
		{"healthy events never delivered (lost)", scalar(`SELECT count(*) FROM soak_enqueued q WHERE q.poison IS NULL
			AND NOT EXISTS (SELECT 1 FROM soak_deliveries d WHERE d.event_id = q.event_id)`)},
		{"healthy events not marked delivered", scalar(`SELECT count(*) FROM soak_enqueued q
			WHERE q.poison IS NULL AND NOT EXISTS (SELECT 1 FROM ` + finalEvents + ` WHERE f.id = q.event_id AND f.status = 'delivered')`)},
		{"enqueued events with neither a row nor a deletion", scalar(`SELECT count(*) FROM soak_enqueued q
			WHERE NOT EXISTS (SELECT 1 FROM ` + finalEvents + ` WHERE f.id = q.event_id)`)},
		{"events with both a row and a deletion, or two deletions", scalar(`SELECT count(*) FROM (
			SELECT f.id FROM ` + finalEvents + ` GROUP BY f.id HAVING count(*) > 1) x`)},
		{"outbox rows no producer committed", scalar(`SELECT count(*) FROM modkit_outbox_events e
			WHERE NOT EXISTS (SELECT 1 FROM soak_enqueued q WHERE q.event_id = e.id)`)},
		{"deliveries of unknown events", scalar(`SELECT count(*) FROM soak_deliveries d
			WHERE NOT EXISTS (SELECT 1 FROM soak_enqueued q WHERE q.event_id = d.event_id)`)},
		{"rows left pending or processing", scalar(`SELECT count(*) FROM modkit_outbox_events WHERE status IN ('pending', 'processing')`)},
		{"rows processing with an expired lease", scalar(`SELECT count(*) FROM modkit_outbox_events WHERE status = 'processing' AND locked_until < now()`)},
		{"dead rows that are not poison", scalar(`SELECT count(*) FROM modkit_outbox_events e
			LEFT JOIN soak_enqueued q ON q.event_id = e.id WHERE e.status = 'dead' AND q.poison IS NULL`)},
		{"poison events not dead", scalar(`SELECT count(*) FROM soak_enqueued q
			JOIN modkit_outbox_events e ON e.id = q.event_id WHERE q.poison IS NOT NULL AND e.status <> 'dead'`)},
		{"transient poison dead before max_attempts", scalar(`SELECT count(*) FROM soak_enqueued q
			JOIN modkit_outbox_events e ON e.id = q.event_id WHERE q.poison = 'transient' AND e.attempts <> $1`, o.maxAttempts)},
		{"poison events delivered", scalar(`SELECT count(*) FROM soak_deliveries d
			JOIN soak_enqueued q USING (event_id) WHERE q.poison IS NOT NULL`)},
		// The audit trail of lease transitions.
		// The sweeper's lease repair puts an expired lease back to pending
		// by design, and records it in the ledger as lease_expired.
		{"settlements under an expired lease", scalar(`SELECT count(*) FROM soak_audit a
			WHERE new_status IN ('delivered', 'pending') AND NOT old_locked_until > at
			  AND NOT (new_status = 'pending' AND EXISTS (SELECT 1 FROM modkit_outbox_attempts l
				WHERE l.event_id = a.event_id AND l.lease_token = a.old_token AND l.outcome = 'lease_expired'
				  AND l.detail LIKE '%repaired by the sweeper%'))`)},
		{"dead-lettered under an expired lease, not by the sweep", scalar(`SELECT count(*) FROM soak_audit
			WHERE new_status = 'dead' AND NOT old_locked_until > at AND new_last_error NOT LIKE '%expired on the final attempt%'`)},
		{"delivered marks by a lease whose publish never reached the downstream", scalar(`SELECT count(*) FROM soak_audit a
			WHERE a.new_status = 'delivered' AND NOT EXISTS (
				SELECT 1 FROM soak_deliveries d WHERE d.event_id = a.event_id AND d.lease_token = a.old_token)`)},
		{"reclaims of a valid lease", scalar(`SELECT count(*) FROM soak_audit
			WHERE new_status = 'processing' AND new_token IS DISTINCT FROM old_token AND old_locked_until > at`)},
	}
	if !o.deleteOnDelivery {
		// The dedupe key makes a producer's retry find its first event.
		mustBeZero = append(mustBeZero, check{"dedupe keys enqueued as two events", r.reenqueued})
	}
	for _, c := range mustBeZero {
		if c.n != 0 {
			r.fail("%s: %d", c.what, c.n)
		}
	}
	r.counts = mustBeZero
	r.attributeDuplicates(ctx, pool, o, incidents)
	return r
}

// attributeDuplicates explains every extra delivery: the delivery before it
// must have been cut short by a fault, a SIGKILL of the process that made
// it, or a PostgreSQL restart around it (whose lost acks and claims can
// surface up to a lease later).
//
// The kill window. A delivery by the killed process counts when it was
// sent before the process was seen dead (sent_at, the process's own clock)
// and the redelivery came after the signal. Its server-side time may lie
// after the death: PostgreSQL reads a statement the client wrote into the
// socket before it died and commits it, noticing the vanished client only
// when it sends the result. Issue 18: on a loaded machine the server began
// such inserts up to 18 ms after the process was seen dead, 24-47 ms after
// the process had sent them, and the verifier, which wanted the delivery
// before the death, called those duplicates unexplained. How late is
// bounded by the lease: recordDelivery stores the lease token only while
// the lease is unexpired at the statement's start (now(), which is
// started_at), and that lease was granted before the process died (the
// process used its claim), so started_at < locked_until <= death + lease.
// A delivery recorded without a lease token (late) gets no such allowance.
func (r *report) attributeDuplicates(ctx context.Context, pool *pgxpool.Pool, o options, incidents []incident) {
	// settled: the delivery's lease recorded it as delivered, a commit the
	// audit (in the same transaction) proves. No fault explains a
	// redelivery after that: the row was delivered, durably.
	rows, err := pool.Query(ctx, `SELECT d.event_id, d.pid, d.lease_token IS NOT NULL, d.sent_at, d.started_at, d.at,
		EXISTS (SELECT 1 FROM soak_audit a WHERE a.event_id = d.event_id AND a.old_token = d.lease_token AND a.new_status = 'delivered')
		FROM soak_deliveries d
		WHERE d.event_id IN (SELECT event_id FROM soak_deliveries GROUP BY event_id HAVING count(*) > 1)
		ORDER BY d.event_id, d.at`)
	if err != nil {
		r.fail("read duplicate deliveries: %v", err)
		return
	}
	defer rows.Close()
	type delivery struct {
		id                uuid.UUID
		pid               int
		leased, settled   bool
		sent, started, at time.Time
	}
	var prev delivery
	var examples []string
	slack := 2 * o.lease
	for rows.Next() {
		var d delivery
		if err := rows.Scan(&d.id, &d.pid, &d.leased, &d.sent, &d.started, &d.at, &d.settled); err != nil {
			r.fail("read duplicate deliveries: %v", err)
			return
		}
		if d.id != prev.id {
			r.eventsDeliveredTwice++
			prev = d
			continue
		}
		r.extraDeliveries++
		cause := ""
		for _, in := range incidents {
			if prev.settled {
				break // delivered for good before it was delivered again
			}
			switch {
			case in.kind == "kill" && in.pid == prev.pid && !prev.sent.After(in.end) && !d.at.Before(in.begin) &&
				(!prev.started.After(in.end) || prev.leased && prev.started.Before(in.end.Add(o.lease))):
				cause = "kill"
				if prev.started.After(in.end) {
					cause = "kill, in flight"
					r.maxInFlightLag = max(r.maxInFlightLag, prev.started.Sub(in.end))
				}
			case in.kind == "restart" && !prev.at.After(in.end.Add(slack)) && !d.at.Before(in.begin):
				if cause == "" {
					cause = "restart"
				}
			}
		}
		switch cause {
		case "kill":
			r.byKill++
		case "kill, in flight":
			r.byKill++
			r.byKillInFlight++
		case "restart":
			r.byRestart++
		default:
			r.unattributed++
			if len(examples) < 5 {
				ex := fmt.Sprintf("event %s delivered by pid %d (sent %s, started %s, at %s, under its lease: %v) and again by pid %d at %s",
					d.id, prev.pid, stamp(prev.sent), stamp(prev.started), stamp(prev.at), prev.leased, d.pid, stamp(d.at))
				for _, in := range incidents {
					if in.kind == "kill" && in.pid == prev.pid {
						ex += fmt.Sprintf("; pid %d SIGKILLed at %s, seen dead at %s", in.pid, stamp(in.begin), stamp(in.end))
					}
				}
				examples = append(examples, ex)
			}
		}
		prev = d
	}
	if err := rows.Err(); err != nil {
		r.fail("read duplicate deliveries: %v", err)
	}
	if r.unattributed > 0 {
		r.fail("%d duplicate deliveries coincide with no kill or restart, e.g.\n    %s", r.unattributed, strings.Join(examples, "\n    "))
	}
}

func stamp(t time.Time) string { return t.UTC().Format("15:04:05.000000") }

func (r *report) print() {
	var b strings.Builder
	fmt.Fprintf(&b, "\n== outbox soak summary ==\n")
	fmt.Fprintf(&b, "run time            %v (seed %d)\n", r.elapsed.Round(time.Second), r.seed)
	fmt.Fprintf(&b, "faults              %d dispatcher SIGKILLs, %d PostgreSQL restarts (immediate); %d dispatcher processes in all\n",
		r.kills, r.restarts, r.generations)
	fmt.Fprintf(&b, "enqueued            %d events: %d healthy, %d poison (%d transient, %d permanent); %d producer retries\n",
		r.enqueued, r.healthy, r.transient+r.permanent, r.transient, r.permanent, r.producerRetries)
	fmt.Fprintf(&b, "outcome             %d delivered, %d dead\n", r.delivered, r.dead)
	if r.reenqueued > 0 {
		fmt.Fprintf(&b, "enqueued again      %d dedupe keys as a second event: a producer retried after an ambiguous commit, and the\n"+
			"                    first event was already delivered and deleted (Publisher.DeleteOnDelivery frees the key)\n", r.reenqueued)
	}
	fmt.Fprintf(&b, "deliveries          %d recorded downstream (%d after their lease ended); %d events delivered more than once, %d extra deliveries\n",
		r.deliveries, r.lateDeliveries, r.eventsDeliveredTwice, r.extraDeliveries)
	fmt.Fprintf(&b, "duplicates due to   %d kills, %d restarts, %d unexplained\n", r.byKill, r.byRestart, r.unattributed)
	if r.byKill > 0 {
		fmt.Fprintf(&b, "  kills             the killed dispatcher had published but not yet recorded the outcome; another claimed the event\n"+
			"                    when its lease expired\n")
	}
	if r.byKillInFlight > 0 {
		fmt.Fprintf(&b, "                    (%d of them written by the server after the process was dead: the insert was in flight at\n"+
			"                    the SIGKILL and PostgreSQL still ran and committed it, at most %v after the death; allowance: one lease, %v)\n",
			r.byKillInFlight, r.maxInFlightLag.Round(time.Millisecond), r.lease)
	}
	if r.byRestart > 0 {
		fmt.Fprintf(&b, "  restarts          the restart cut the dispatcher's connections between a publish and its recorded outcome\n"+
			"                    (not written before the lease ended, or the delivery committed but its reply was lost\n"+
			"                    and the publish counted as failed); the event was delivered again\n")
	}
	if r.unattributed > 0 {
		fmt.Fprintf(&b, "  unexplained       no kill of the delivering process and no restart around it: a lost outcome to investigate\n")
	}
	fmt.Fprintf(&b, "lease audit         %d transitions out of processing checked\n", r.audited)
	for _, c := range r.counts {
		fmt.Fprintf(&b, "  %-72s %d\n", c.what, c.n)
	}
	fmt.Fprintf(&b, "dispatcher logs     %s\n", r.logDir)
	if len(r.failures) == 0 {
		fmt.Fprintf(&b, "RESULT              PASS: nothing lost, duplicates explained by faults, table consistent\n")
	} else {
		fmt.Fprintf(&b, "RESULT              FAIL\n")
		for _, f := range r.failures {
			fmt.Fprintf(&b, "  - %s\n", f)
		}
	}
	fmt.Print(b.String())
}
