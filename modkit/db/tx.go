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
// with any rollback error) or panics (the panic continues after the
// rollback).
func InTx(ctx context.Context, b TxBeginner, fn func(ctx context.Context, tx pgx.Tx) error) (err error) {
	tx, err := b.Begin(ctx)
	if err != nil {
		return fmt.Errorf("modkit/db: begin: %w", err)
	}
	defer func() {
		if p := recover(); p != nil {
			// The rollback must run even when ctx is already cancelled.
			_ = tx.Rollback(context.WithoutCancel(ctx))
			panic(p)
		}
	}()
	if err := fn(ctx, tx); err != nil {
		if rbErr := tx.Rollback(context.WithoutCancel(ctx)); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			return errors.Join(err, fmt.Errorf("modkit/db: rollback: %w", rbErr))
		}
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("modkit/db: commit: %w", err)
	}
	return nil
}

// InTx runs fn in a transaction on the provider's pool; see the package-level
// InTx.
func (p *Provider) InTx(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return InTx(ctx, p.Pool, fn)
}
