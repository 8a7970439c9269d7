package db

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// TxBeginner starts pgx transactions: *pgxpool.Pool, *pgxpool.Conn, *pgx.Conn,
// and pgx.Tx (which starts a savepoint).
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// InTx begins a transaction on b, runs fn in it and commits when fn returns
// nil. It rolls back when fn returns an error (returned unchanged, joined
// with any rollback error), panics (the panic continues after the rollback)
// or ends its goroutine with runtime.Goexit (as t.Fatal does in a test), so
// the transaction never stays open on its connection. fn must not commit
// or roll back tx itself: when it does, InTx returns an error saying so,
// matching pgx.ErrTxClosed (joined with fn's own error, if it returned
// one: what fn committed stays).
func InTx(ctx context.Context, b TxBeginner, fn func(ctx context.Context, tx pgx.Tx) error) (err error) {
	tx, err := b.Begin(ctx)
	if err != nil {
		return fmt.Errorf("modkit/db: begin: %w", err)
	}
	returned := false
	defer func() {
		if !returned { // fn panicked or called runtime.Goexit
			// The rollback must run even when ctx is already cancelled.
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	err = fn(ctx, tx)
	returned = true
	if err != nil {
		rbErr := tx.Rollback(context.WithoutCancel(ctx))
		switch {
		case errors.Is(rbErr, pgx.ErrTxClosed):
			// fn ended the transaction itself, then failed: the caller
			// must not take the error for "nothing was written".
			return errors.Join(err, fmt.Errorf("modkit/db: InTx: the function committed or rolled back the transaction "+
				"itself before returning its error, so InTx could not roll it back: what it committed stays: %w", rbErr))
		case rbErr != nil:
			return errors.Join(err, fmt.Errorf("modkit/db: rollback: %w", rbErr))
		}
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		if errors.Is(err, pgx.ErrTxClosed) {
			// pgx's "tx is closed" does not say who closed it: fn did.
			return fmt.Errorf("modkit/db: InTx: the function committed or rolled back the transaction itself; "+
				"InTx commits it when the function returns nil and rolls it back when it returns an error, "+
				"so leave tx open and return: %w", err)
		}
		return fmt.Errorf("modkit/db: commit: %w", err)
	}
	return nil
}

// InTx runs fn in a transaction on the provider's pool; see the package-level
// InTx.
func (p *Provider) InTx(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return InTx(ctx, p.Pool, fn)
}
