// Package termlog builds the slog handlers of the repository's commands
// (the demos, outbox-bench): tint's readable lines, coloured only when they
// go to a terminal, so that output piped to a file or another program has
// no ANSI escape codes in it.
package termlog

import (
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/lmittmann/tint"
)

// NewHandler returns a tint handler writing to w at level, with times of
// day, coloured when w is a terminal (see Colour).
func NewHandler(w io.Writer, level slog.Leveler) slog.Handler {
	return tint.NewTextHandler(w, &tint.Options{Level: level, TimeFormat: time.TimeOnly, NoColor: !Colour(w)})
}

// Colour reports whether output to w may be coloured: w is an *os.File
// open on a character device, as a terminal is, and NO_COLOR is not set
// (no-color.org). A file, a pipe, or a writer that is no *os.File gets
// none. (/dev/null is a character device too; what goes there is never
// read.)
func Colour(w io.Writer) bool {
	if os.Getenv("NO_COLOR") != "" {
		return false
	}
	f, ok := w.(*os.File)
	if !ok || f == nil {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
