// Package app wires Mini Chat together as an fx application (the db,
// outbox, chat and usage modules) and drives the demo scenario: simulated
// users run turns with mixed outcomes, the usage events flow through the
// outbox to the collector, and the result is reconciled against the chat
// tables.
//
// Every run uses two fresh tenants and reconciles only their rows, so runs
// can share a database (DATABASE_URL) with earlier runs or other data.
package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.uber.org/fx"
	"go.uber.org/fx/fxevent"

	"github.com/modkit-go/modkit/examples/minichat/chat"
	minichatmigrations "github.com/modkit-go/modkit/examples/minichat/migrations"
	"github.com/modkit-go/modkit/examples/minichat/usage"
	"github.com/modkit-go/modkit/modkit/db"
	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// Defaults of Options.
const (
	TurnsDefault                = 400
	UsersDefault                = 8
	RaceEveryDefault            = 40
	TransientFailureRateDefault = 0.1
	MalformedEventsDefault      = 3
	DrainTimeoutDefault         = 2 * time.Minute
)

// Options configure a scenario run. The zero value of every field but DSN
// takes its default.
type Options struct {
	// DSN of the database to use. Required.
	DSN string
	// Turns in total, spread over Users. Default TurnsDefault.
	Turns int
	// Users driving turns concurrently, spread over two tenants. Default
	// UsersDefault.
	Users int
	// RaceEvery makes every n-th turn of a user a watchdog race: the normal
	// path and the watchdog finalise it at the same moment. Default
	// RaceEveryDefault; the first turn of the first user always races.
	RaceEvery int
	// TransientFailureRate is the fraction of first deliveries that the
	// collector fails, to show retries. Default
	// TransientFailureRateDefault; negative disables.
	TransientFailureRate float64
	// MalformedEvents is how many probe events with a broken payload are
	// enqueued, to show dead letters. Default MalformedEventsDefault;
	// negative disables.
	MalformedEvents int
	// Seed seeds the simulated outcomes and the injected failures (which
	// turns fail still depends on timing). Default 1.
	Seed uint64
	// DrainTimeout bounds the wait for every turn to be final and every
	// event to be delivered or dead. Default DrainTimeoutDefault.
	DrainTimeout time.Duration
	// Logger for the modules and the outbox. Default slog.Default().
	Logger *slog.Logger
	// Progress, if set, is called about once a second while the scenario
	// runs.
	Progress func(Progress)
}

func (o Options) withDefaults() Options {
	o.Turns = positiveOr(o.Turns, TurnsDefault)
	o.Users = positiveOr(o.Users, UsersDefault)
	o.RaceEvery = positiveOr(o.RaceEvery, RaceEveryDefault)
	switch {
	case o.MalformedEvents == 0:
		o.MalformedEvents = MalformedEventsDefault
	case o.MalformedEvents < 0:
		o.MalformedEvents = 0
	}
	switch {
	case o.TransientFailureRate == 0:
		o.TransientFailureRate = TransientFailureRateDefault
	case o.TransientFailureRate < 0:
		o.TransientFailureRate = 0
	}
	o.Seed = max(o.Seed, 1)
	if o.DrainTimeout <= 0 {
		o.DrainTimeout = DrainTimeoutDefault
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
}

func positiveOr(v, def int) int {
	if v > 0 {
		return v
	}
	return def
}

// Progress is a snapshot of a running scenario.
type Progress struct {
	// Elapsed is the time since the scenario started.
	Elapsed time.Duration
	// TurnsStarted of TurnsGoal have started; TurnsFinal were finalised by
	// this process (including any leftovers of earlier runs its watchdog
	// found).
	TurnsStarted, TurnsGoal, TurnsFinal int64
	// Delivered, Retried (failed attempts rescheduled) and Dead count the
	// dispatcher's outcomes for this run's events.
	Delivered, Retried, Dead int64
}

// Migrate applies the outbox migrations (with outbox.Client.Migrate) and
// Mini Chat's own (tracking table minichatmigrations.Table) to the
// database at dsn. It runs before the fx app exists, so it builds an
// outbox client of its own with outbox.New.
func Migrate(ctx context.Context, dsn string, log *slog.Logger) error {
	prov, err := db.Open(ctx, db.Config{DSN: dsn})
	if err != nil {
		return fmt.Errorf("minichat: migrate: %w", err)
	}
	defer prov.Close()
	client, err := outbox.New(outboxpg.New(prov.Pool), outbox.Config{Logger: log})
	if err != nil {
		return fmt.Errorf("minichat: migrate: %w", err)
	}
	if err := client.Migrate(ctx); err != nil {
		return fmt.Errorf("minichat: migrate: %w", err)
	}
	m, err := db.NewMigrator(prov.Pool, db.MigratorConfig{Logger: log, FS: minichatmigrations.FS, Table: minichatmigrations.Table})
	if err != nil {
		return fmt.Errorf("minichat: migrate: %w", err)
	}
	if _, err := m.Up(ctx); err != nil {
		return fmt.Errorf("minichat: migrate: %w", err)
	}
	return nil
}

// Run migrates the database, starts the fx app, drives the scenario, waits
// until every turn is final and every event delivered or dead, reconciles,
// stops the app and returns the summary. The error is for failures to run
// at all; a run whose totals do not reconcile returns a Summary with
// Reconciled false.
func Run(ctx context.Context, opts Options) (Summary, error) {
	opts = opts.withDefaults()
	if opts.DSN == "" {
		return Summary{}, errors.New("minichat: Options.DSN is required")
	}
	if err := Migrate(ctx, opts.DSN, opts.Logger); err != nil {
		return Summary{}, err
	}
	sc := newScenario(opts)
	app := fx.New(sc.appOptions()...)
	if err := app.Err(); err != nil {
		return Summary{}, fmt.Errorf("minichat: build app: %w", err)
	}
	startCtx, cancelStart := context.WithTimeout(ctx, 30*time.Second)
	defer cancelStart()
	if err := app.Start(startCtx); err != nil {
		return Summary{}, fmt.Errorf("minichat: start app: %w", err)
	}

	sum, runErr := sc.drive(ctx)

	// Stop even when ctx was cancelled (a signal): the dispatcher then
	// gives its in-flight events back before the database goes away.
	stopCtx, cancelStop := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancelStop()
	if err := app.Stop(stopCtx); err != nil {
		runErr = errors.Join(runErr, fmt.Errorf("minichat: stop app: %w", err))
	}
	return sum, runErr
}

// appOptions is the fx application: the library's db and outbox modules,
// Mini Chat's chat and usage modules, and the demo's configuration.
func (sc *scenario) appOptions() []fx.Option {
	opts := sc.opts
	return []fx.Option{
		fx.Supply(db.Config{DSN: opts.DSN, MaxConns: 24}, opts.Logger),
		fx.Supply(outbox.DispatcherConfig{
			// Short delays so that the injected failures are retried within
			// the demo; five attempts are plenty for failures that only hit
			// first attempts.
			Retry:       outbox.RetryPolicy{BaseDelay: 50 * time.Millisecond, MaxDelay: 400 * time.Millisecond},
			MaxAttempts: 5,
			// A transactional handler holds a pool connection for its
			// publish: keep the workers well below the pool size, which the
			// simulated users share.
			Concurrency:   8,
			LeaseDuration: 10 * time.Second,
			PollInterval:  250 * time.Millisecond,
			OnOutcome:     sc.track.outcome,
		}),
		fx.Supply(chat.Config{WatchdogInterval: 100 * time.Millisecond, OrphanAfter: 250 * time.Millisecond,
			OnCommitted: sc.lat.committed}),
		fx.Supply(usage.Config{TransientFailureRate: opts.TransientFailureRate, Seed: opts.Seed, OnFirstSeen: sc.lat.seen}),
		db.Module,
		outbox.Module,
		chat.Module,
		usage.Module,
		fx.Populate(&sc.svc, &sc.collector, &sc.prov, &sc.outbox),
		fx.WithLogger(func() fxevent.Logger { return &fxevent.SlogLogger{Logger: opts.Logger.With("component", "fx")} }),
	}
}
