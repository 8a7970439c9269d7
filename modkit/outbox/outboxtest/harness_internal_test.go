package outboxtest

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
)

// infoAsDebug lowers Info records to Debug and leaves warnings and errors
// at their level, through WithAttrs and WithGroup too.
func TestInfoAsDebugKeepsWarningsAndErrors(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(infoAsDebug{slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})}).With("schema", "shop")
	log.Info("migration applied")
	log.Debug("a detail")
	log.Warn("the migrating role may not create roles")
	log.WithGroup("g").Error("migration failed")
	out := buf.String()
	if strings.Contains(out, "migration applied") || strings.Contains(out, "a detail") ||
		!strings.Contains(out, "level=WARN msg=\"the migrating role may not create roles\" schema=shop") ||
		!strings.Contains(out, "level=ERROR msg=\"migration failed\"") {
		t.Fatalf("at Info, infoAsDebug printed:\n%s", out)
	}
	buf.Reset()
	debug := slog.New(infoAsDebug{slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})})
	debug.Info("migration applied")
	if out := buf.String(); !strings.Contains(out, "level=DEBUG msg=\"migration applied\"") {
		t.Fatalf("at Debug, infoAsDebug printed:\n%s", out)
	}
}

// Drain's log goes to the test's log only until Drain has stopped its
// dispatcher: a publish abandoned at its deadline can return, and be
// logged, after the test has ended, when t.Logf panics and ends the
// whole test binary (a review reproduced it). The lines are still kept.
func TestDrainLogEndsWithTheDrain(t *testing.T) {
	var logged []string
	l := &lastLines{logf: func(format string, args ...any) { logged = append(logged, fmt.Sprintf(format, args...)) }}
	fmt.Fprintln(l, "during")
	l.log("dead-lettered")
	l.endLog()
	fmt.Fprintln(l, "after")
	l.log("after")
	if len(logged) != 2 || !strings.Contains(logged[0], "during") || !strings.Contains(logged[1], "dead-lettered") {
		t.Fatalf("logged %q; want the two lines before endLog only", logged)
	}
	if !strings.Contains(l.String(), "after") {
		t.Fatalf("kept %q; want the line after endLog kept", l.String())
	}
}
