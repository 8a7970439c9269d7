package db_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/modkit-go/modkit/internal/pgtest"
	"github.com/modkit-go/modkit/modkit/db"
)

func TestInTx(t *testing.T) {
	ctx := context.Background()
	p := pgtest.NewDB(t).Provider
	if _, err := p.Pool.Exec(ctx, "CREATE TABLE runner_probe (name text NOT NULL, v int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	insert := func(name string) func(context.Context, pgx.Tx) error {
		return func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO runner_probe VALUES ($1, 1)", name)
			return err
		}
	}

	if err := p.InTx(ctx, insert("committed")); err != nil {
		t.Fatal(err)
	}
	if c := count(t, p, "committed"); c != 1 {
		t.Fatalf("commit: %d rows, want 1", c)
	}

	boom := errors.New("boom")
	err := p.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
		if err := insert("failed")(ctx, tx); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("want the function's error back, got %v", err)
	}
	if c := count(t, p, "failed"); c != 0 {
		t.Fatalf("error: %d rows, want 0 (rolled back)", c)
	}

	func() {
		defer func() {
			if r := recover(); r != "kaboom" {
				t.Fatalf("want the panic to continue, recovered %v", r)
			}
		}()
		_ = db.InTx(ctx, p.Pool, func(ctx context.Context, tx pgx.Tx) error {
			if err := insert("panicked")(ctx, tx); err != nil {
				return err
			}
			panic("kaboom")
		})
	}()
	if c := count(t, p, "panicked"); c != 0 {
		t.Fatalf("panic: %d rows, want 0 (rolled back)", c)
	}
	// The pool is still healthy: the panicking transaction's connection went back clean.
	if st := p.Pool.Stat(); st.AcquiredConns() != 0 {
		t.Fatalf("%d connections still acquired after InTx", st.AcquiredConns())
	}

	// fn ends its goroutine (runtime.Goexit, as t.Fatal does): rolled back,
	// and the connection goes back to the pool, which can then close.
	exited := make(chan struct{})
	var inserted atomic.Bool
	go func() {
		defer close(exited)
		_ = db.InTx(ctx, p.Pool, func(ctx context.Context, tx pgx.Tx) error {
			if err := insert("exited")(ctx, tx); err != nil {
				return err
			}
			inserted.Store(true)
			runtime.Goexit()
			return nil
		})
	}()
	<-exited
	if !inserted.Load() {
		t.Fatal("the row was not inserted before Goexit, so its rollback is not tested")
	}
	if c := count(t, p, "exited"); c != 0 {
		t.Fatalf("Goexit: %d rows, want 0 (rolled back)", c)
	}
	if st := p.Pool.Stat(); st.AcquiredConns() != 0 {
		t.Fatalf("%d connections still acquired after InTx whose fn called runtime.Goexit", st.AcquiredConns())
	}
}

// A function that commits or rolls back the transaction itself gets an
// error saying that it did, and that InTx does it for it (pgx's "tx is
// closed" said neither), still matching pgx.ErrTxClosed.
func TestInTxFunctionEndsTheTransactionItself(t *testing.T) {
	ctx := context.Background()
	p := pgtest.NewDB(t).Provider
	for name, end := range map[string]func(context.Context, pgx.Tx) error{
		"commits":    func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) },
		"rolls back": func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) },
	} {
		err := p.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
			if err := end(ctx, tx); err != nil {
				t.Fatalf("the function %s: %v", name, err)
			}
			return nil
		})
		if !errors.Is(err, pgx.ErrTxClosed) || !strings.Contains(err.Error(), "the function committed or rolled back the transaction itself") {
			t.Errorf("InTx whose function %s the transaction: %v; want pgx.ErrTxClosed saying the function ended it", name, err)
		}
		// Ended, then failed: the function's error, and that what it
		// committed stays (InTx could not roll back).
		failed := errors.New("failed after ending it")
		err = p.InTx(ctx, func(ctx context.Context, tx pgx.Tx) error {
			if err := end(ctx, tx); err != nil {
				t.Fatalf("the function %s: %v", name, err)
			}
			return failed
		})
		if !errors.Is(err, failed) || !errors.Is(err, pgx.ErrTxClosed) || !strings.Contains(err.Error(), "what it committed stays") {
			t.Errorf("InTx whose function %s the transaction and fails: %v; want its error and that what it committed stays", name, err)
		}
	}
	if st := p.Pool.Stat(); st.AcquiredConns() != 0 {
		t.Fatalf("%d connections still acquired after InTx", st.AcquiredConns())
	}
}
