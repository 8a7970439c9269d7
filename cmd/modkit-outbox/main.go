// Command modkit-outbox operates a modkit transactional outbox from the
// shell: it migrates the schema, prints the migrations for other tools,
// shows statistics and events, replays or purges dead events, skips the
// dead head of an ordering key, purges delivered ones, follows deliveries
// live and serves the web dashboard.
//
// Install it with
//
//	go install github.com/modkit-go/modkit/cmd/modkit-outbox@latest
//
// and run `modkit-outbox help` for the commands. Every command that needs
// the database takes --database-url (default: the DATABASE_URL
// environment variable) and --schema (default: the MODKIT_OUTBOX_SCHEMA
// environment variable, else public), before or after the command.
//
// Exit codes: 0 success; 1 the operation failed; 2 bad command line; 3 the
// database cannot be reached; 4 an event was not found (for dead
// skip-head: no dead head holds the key back); 5 aborted, because a
// confirmation was not given.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// Exit codes.
const (
	exitOK          = 0
	exitFailure     = 1
	exitUsage       = 2
	exitUnreachable = 3
	exitNotFound    = 4
	exitAborted     = 5
)

// exitError carries an exit code with its message.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageErr(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

func withCode(code int, err error) error { return &exitError{code: code, err: err} }

// env is what a command sees of the process: its streams and environment.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
	// interactive tells whether stdin is a terminal a person can answer
	// confirmations on.
	interactive bool
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal asks the command to stop; a second one ends the
	// process at once, as it would without the first being caught.
	go func() {
		<-ctx.Done()
		stop()
	}()
	e := env{stdin: os.Stdin, stdout: os.Stdout, stderr: os.Stderr, getenv: os.Getenv, interactive: isTerminal(os.Stdin)}
	os.Exit(run(ctx, e, os.Args[1:]))
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// command is one subcommand: its help and what it does.
type command struct {
	name, summary string
	run           func(ctx context.Context, e env, args []string) error
}

func commands() []command {
	return []command{
		{"migrate", "apply, revert, list or print the outbox migrations", runMigrate},
		{"stats", "count events per namespace, topic and status; list blocked keys and topics no dispatcher serves", runStats},
		{"events", "list events with filters, or show one", runEvents},
		{"dead", "replay or purge dead events (by id or filter), skip an ordering key's dead head, or dead-letter pending events", runDead},
		{"purge", "delete delivered events of topics older than a retention, or the sequence rows of ordering keys without events", runPurge},
		{"tail", "follow deliveries and dead letters live", runTail},
		{"serve", "serve the web dashboard", runServe},
	}
}

const mainUsage = `modkit-outbox operates a modkit transactional outbox on PostgreSQL.

Usage:
  modkit-outbox COMMAND [flags] [arguments]

Commands:
%s
Every command but migrate sql (which prints the migrations without
connecting) takes --database-url (default $DATABASE_URL) and --schema
(default $MODKIT_OUTBOX_SCHEMA, else public), before or after the
command. A command on a schema that holds no outbox while another schema
does is refused, naming that schema; migrate up asks first when the
schema is public by default. "modkit-outbox COMMAND --help" shows a command's flags
and examples.

Examples:
  export DATABASE_URL=postgres://app@db.internal/app
  modkit-outbox migrate up
  modkit-outbox stats
  modkit-outbox events list --status dead --topic shop/order_paid
  modkit-outbox dead replay --topic shop/order_paid --dry-run
  modkit-outbox dead skip-head --topic shop/order_paid --key acct-7
  MODKIT_OUTBOX_TOKEN=$(openssl rand -hex 16) modkit-outbox serve --addr 127.0.0.1:8080

Exit codes:
  0  success
  1  the operation failed
  2  bad command line
  3  the database cannot be reached
  4  an event was not found (dead skip-head: no dead head holds the key back)
  5  aborted: a confirmation was not given
`

func printMainUsage(w io.Writer) {
	var list string
	for _, c := range commands() {
		list += fmt.Sprintf("  %-9s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, mainUsage, list)
}

// run executes one command line and returns the process exit code.
func run(ctx context.Context, e env, args []string) int {
	if len(args) == 0 {
		printMainUsage(e.stderr)
		return exitUsage
	}
	isHelp := func(a string) bool { return a == "help" || a == "-h" || a == "-help" || a == "--help" }
	if strings.HasPrefix(args[0], "-") && !isHelp(args[0]) {
		// The connection flags may come before the command too (as in
		// modkit-outbox --schema shop stats): they go right after it, so
		// that the same flag given after the command wins. Help needs
		// none of them.
		lead, rest, err := leadingFlags(args)
		if err != nil {
			fmt.Fprintf(e.stderr, "modkit-outbox: %v\n", err)
			return exitUsage
		}
		args = rest
		if !isHelp(rest[0]) {
			args = append(append(rest[:1:1], lead...), rest[1:]...)
		}
	}
	if isHelp(args[0]) {
		if len(args) > 1 {
			return run(ctx, e, []string{args[1], "--help"})
		}
		printMainUsage(e.stdout)
		return exitOK
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return report(e, c.name, c.run(ctx, e, args[1:]))
		}
	}
	fmt.Fprintf(e.stderr, "modkit-outbox: unknown command %q; run \"modkit-outbox help\" for the list\n", args[0])
	return exitUsage
}

// leadingFlags splits a command line that starts with flags into those
// flags and the rest, which starts with the command. Only the connection
// flags every command takes may come first.
func leadingFlags(args []string) (lead, rest []string, err error) {
	for len(args) > 0 && strings.HasPrefix(args[0], "-") {
		name, _, hasValue := strings.Cut(strings.TrimLeft(args[0], "-"), "=")
		if name != "database-url" && name != "schema" && name != "connect-timeout" {
			return nil, nil, fmt.Errorf("%s before the command: only --database-url, --schema and --connect-timeout may come "+
				"before it; put the others after it (modkit-outbox COMMAND [flags])", args[0])
		}
		n := 1
		if !hasValue {
			n = 2
		}
		if len(args) < n {
			return nil, nil, fmt.Errorf("%s needs a value", args[0])
		}
		lead, args = append(lead, args[:n]...), args[n:]
	}
	if len(args) == 0 {
		return nil, nil, errors.New("no command after the flags; run \"modkit-outbox help\" for the list")
	}
	return lead, args, nil
}

// report prints err, of the command cmd, and maps it to an exit code.
func report(e env, cmd string, err error) int {
	if err == nil {
		return exitOK
	}
	if errors.Is(err, errHelp) {
		return exitOK
	}
	fmt.Fprintln(e.stderr, "modkit-outbox:", err)
	if hint := hintFor(cmd, err); hint != "" {
		fmt.Fprintln(e.stderr, "modkit-outbox:", hint)
	}
	var x *exitError
	if errors.As(err, &x) {
		return x.code
	}
	return exitFailure
}

// hintFor says what to do about a database error of the command cmd whose
// own message speaks to an application (Client.Migrate) or only names the
// object refused. The server's own hint, when it gave one, comes first.
func hintFor(cmd string, err error) string {
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, outbox.ErrNotMigrated):
		return "from the shell: modkit-outbox migrate up (with the same --schema)"
	case errors.As(err, &pgErr) && pgErr.Hint != "":
		return pgErr.Hint
	case errors.As(err, &pgErr) && pgErr.Code == "42501" && cmd == "migrate":
		return "the database role may not do this: migrating needs the schema's owner, or a role that may create in it " +
			"(and, for the outbox's roles, create roles), such as a superuser"
	case errors.As(err, &pgErr) && pgErr.Code == "42501": // insufficient_privilege
		return "the database role may not do this: reading needs modkit_outbox_reader; replay, purge, skip-head and " +
			"dead letter need modkit_outbox_operator (grant it to the role, or connect as one that has it)"
	}
	return ""
}
