package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// EventJSON is an event as the JSON outputs print it. (Exported only so
// that encoding/json can fill eventView's embedded pointer to it.)
type EventJSON struct {
	ID            string          `json:"id"`
	Namespace     string          `json:"namespace"`
	Topic         string          `json:"topic"`
	TenantID      *string         `json:"tenant_id"`
	DedupeKey     *string         `json:"dedupe_key"`
	OrderingKey   string          `json:"ordering_key,omitempty"` // absent without a key
	Sequence      int64           `json:"sequence,omitempty"`     // the event's place in its key, from 1; absent without a key
	Status        outbox.Status   `json:"status"`
	Attempts      int             `json:"attempts"`
	NextAttemptAt *time.Time      `json:"next_attempt_at"` // when a pending event is due; null for the others, which await no attempt
	LockedBy      *string         `json:"locked_by,omitempty"`
	LockedUntil   *time.Time      `json:"locked_until,omitempty"`
	LastError     *string         `json:"last_error"`
	CreatedAt     time.Time       `json:"created_at"`
	UpdatedAt     time.Time       `json:"updated_at"`
	Payload       json.RawMessage `json:"payload,omitempty"`
}

func toJSON(ev outbox.Event, withPayload bool) EventJSON {
	j := EventJSON{ID: ev.ID.String(), Namespace: ev.Namespace, Topic: ev.Topic, DedupeKey: ev.DedupeKey, Status: ev.Status,
		Attempts: ev.Attempts, LastError: ev.LastError,
		CreatedAt: ev.CreatedAt.UTC(), UpdatedAt: ev.UpdatedAt.UTC(), OrderingKey: ev.OrderingKey, Sequence: ev.Sequence}
	// The row keeps the time its last attempt was due; only a pending
	// event has one to come.
	if ev.Status == outbox.StatusPending {
		t := ev.NextAttemptAt.UTC()
		j.NextAttemptAt = &t
	}
	if ev.TenantID != nil {
		s := ev.TenantID.String()
		j.TenantID = &s
	}
	if ev.LockedBy != nil {
		s := ev.LockedBy.String()
		j.LockedBy = &s
	}
	if ev.LockedUntil != nil {
		t := ev.LockedUntil.UTC()
		j.LockedUntil = &t
	}
	if withPayload {
		j.Payload = json.RawMessage(ev.Payload)
	}
	return j
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

const timeLayout = "2006-01-02 15:04:05Z"

func fmtTime(t time.Time) string { return t.UTC().Format(timeLayout) }

// fmtAge prints a duration rounded to seconds, "-" for zero.
func fmtAge(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	if d < time.Second {
		return "<1s"
	}
	return d.Round(time.Second).String()
}

// oneLine shortens s to one line of at most n runes.
func oneLine(s *string, n int) string {
	if s == nil {
		return ""
	}
	v := strings.Join(strings.Fields(*s), " ")
	if r := []rune(v); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return v
}

// confirm asks on the terminal; without one (or without a "yes") it
// aborts, telling the user to pass --yes.
func confirm(e env, question string) error {
	if !e.interactive {
		return withCode(exitAborted, fmt.Errorf("%s\nnot confirmed: stdin is not a terminal; pass --yes to go ahead", question))
	}
	fmt.Fprintf(e.stderr, "%s Type yes to go ahead: ", question)
	line, err := bufio.NewReader(e.stdin).ReadString('\n')
	if err != nil && strings.TrimSpace(line) == "" {
		// No answer: stdin ended (/dev/null, which passes for a terminal
		// under systemd, docker run without -i, cron).
		fmt.Fprintln(e.stderr)
		return withCode(exitAborted, errors.New("not confirmed: stdin ended without an answer; pass --yes to go ahead; nothing was changed"))
	}
	if strings.TrimSpace(line) != "yes" {
		return withCode(exitAborted, fmt.Errorf("aborted: nothing was changed"))
	}
	return nil
}
