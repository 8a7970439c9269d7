package outboxtest

import (
	"bytes"
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
