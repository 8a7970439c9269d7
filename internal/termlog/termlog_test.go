package termlog

import (
	"bytes"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Output goes coloured only to a character device (a terminal; /dev/null
// stands in for one here): not to a file, a pipe or another writer, where
// the demos wrote ANSI escape codes into what was piped to a file.
func TestColour(t *testing.T) {
	t.Setenv("NO_COLOR", "") // as if unset, whatever the environment says
	file, err := os.Create(filepath.Join(t.TempDir(), "out.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for name, tc := range map[string]struct {
		w    io.Writer
		want bool
	}{
		"a file":         {file, false},
		"a pipe":         {w, false},
		"a bytes.Buffer": {&bytes.Buffer{}, false},
		"a nil *os.File": {(*os.File)(nil), false},
	} {
		if got := Colour(tc.w); got != tc.want {
			t.Errorf("Colour(%s) = %v, want %v", name, got, tc.want)
		}
	}
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Skipf("no %s to stand in for a terminal: %v", os.DevNull, err)
	}
	defer null.Close()
	if !Colour(null) {
		t.Errorf("Colour(%s) = false, want true for a character device", os.DevNull)
	}
	t.Setenv("NO_COLOR", "1")
	if Colour(null) {
		t.Errorf("Colour(%s) with NO_COLOR set = true, want false", os.DevNull)
	}
}

// A handler writing to a file writes no escape codes.
func TestNewHandlerWritesPlainTextToAFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "out.log")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	slog.New(NewHandler(f, slog.LevelInfo)).Error("demo failed", "error", "boom")
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(got), "demo failed") || strings.Contains(string(got), "\x1b[") {
		t.Fatalf("logged to a file: %q, want the line without ANSI escape codes", got)
	}
}
