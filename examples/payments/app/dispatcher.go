package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// Rail limits, checked before anything is sent.
const (
	// MaxAmountMinor is the largest payment the rail takes, in minor units.
	MaxAmountMinor = 5_000_000
	// RailConcurrency is the most payments one dispatcher has in flight
	// to the rail (Publisher.Concurrency).
	RailConcurrency = 4
	// RailTimeout is the hard timeout of one request to the rail.
	RailTimeout = 400 * time.Millisecond
)

// Currencies the rail settles.
var Currencies = map[string]bool{"EUR": true, "GBP": true, "USD": true}

// destinationPattern is the form of an account on the rail (IBAN-like).
var destinationPattern = regexp.MustCompile(`^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,30}$`)

// ErrInvalidPayment is the error of a payment the rail would refuse. The
// dispatcher dead-letters it at once (outbox.Permanent): no retry can make
// it valid.
var ErrInvalidPayment = errors.New("invalid payment")

// ValidatePayment checks amount, currency and destination against the
// rail's rules.
func ValidatePayment(p Payment) error {
	switch {
	case p.AmountMinor <= 0 || p.AmountMinor > MaxAmountMinor:
		return fmt.Errorf("%w: amount %d outside 1..%d", ErrInvalidPayment, p.AmountMinor, MaxAmountMinor)
	case !Currencies[p.Currency]:
		return fmt.Errorf("%w: currency %q not settled by the rail", ErrInvalidPayment, p.Currency)
	case !destinationPattern.MatchString(p.Destination):
		return fmt.Errorf("%w: destination %q is not an account", ErrInvalidPayment, p.Destination)
	}
	return nil
}

// RailError is a failed request to the rail: a status other than 200.
type RailError struct {
	Status int
	Body   string
}

func (e *RailError) Error() string { return fmt.Sprintf("rail answered %d: %s", e.Status, e.Body) }

// RailPublisher sends each delivery to the rail at railURL: validation
// first (invalid: permanent), then one POST under a hard timeout, with the
// instruction id as idempotency key. 5xx, timeouts and connection errors
// are retried; 4xx are permanent.
func RailPublisher(railURL string, client *http.Client) outbox.Publisher {
	self := strconv.Itoa(os.Getpid())
	return outbox.Publisher{
		Topic:       Topic,
		Name:        "rail",
		Concurrency: RailConcurrency,
		Publish: func(ctx context.Context, d outbox.Delivery) error {
			var p Payment
			if err := json.Unmarshal(d.Payload, &p); err != nil {
				return outbox.Permanent(fmt.Errorf("%w: payload: %v", ErrInvalidPayment, err))
			}
			if err := ValidatePayment(p); err != nil {
				return outbox.Permanent(err)
			}
			key := d.Headers[HeaderIdempotencyKey]
			if key == "" || key != p.InstructionID {
				return outbox.Permanent(fmt.Errorf("%w: no idempotency key", ErrInvalidPayment))
			}
			ctx, cancel := context.WithTimeout(ctx, RailTimeout)
			defer cancel()
			body, _ := json.Marshal(p)
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, railURL+"/payments", bytes.NewReader(body))
			if err != nil {
				return outbox.Permanent(err)
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set(HeaderIdempotencyKey, key)
			req.Header.Set(HeaderSequence, strconv.FormatInt(p.Seq, 10))
			req.Header.Set(HeaderDispatcher, self)
			resp, err := client.Do(req)
			if err != nil {
				return fmt.Errorf("rail: %w", err)
			}
			defer resp.Body.Close()
			msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			railErr := &RailError{Status: resp.StatusCode, Body: string(bytes.TrimSpace(msg))}
			switch {
			case resp.StatusCode >= 200 && resp.StatusCode < 300: // paid, or accepted for payment
				return nil
			case resp.StatusCode >= 500, resp.StatusCode == http.StatusRequestTimeout, resp.StatusCode == http.StatusConflict,
				resp.StatusCode == http.StatusTooEarly, resp.StatusCode == http.StatusTooManyRequests:
				// The rail's trouble, a request still in flight under the
				// same idempotency key, or a rate limit: the same
				// request may succeed later.
				return railErr
			default: // the rail refuses this payment: no retry can change it
				return outbox.Permanent(railErr)
			}
		},
	}
}

// DispatcherConfig is the dispatchers' configuration: a short lease, so
// that a killed dispatcher's claims pass to another soon.
func DispatcherConfig(logger *slog.Logger) outbox.DispatcherConfig {
	return outbox.DispatcherConfig{
		LeaseDuration: 2 * time.Second,
		PollInterval:  100 * time.Millisecond,
		BatchSize:     16,
		Concurrency:   RailConcurrency,
		MaxAttempts:   30, // a valid payment must not run out of attempts on a loaded machine
		Retry:         outbox.RetryPolicy{BaseDelay: 10 * time.Millisecond, MaxDelay: 200 * time.Millisecond},
		SweepInterval: 200 * time.Millisecond,
		StopTimeout:   5 * time.Second,
		Logger:        logger,
	}
}

// Environment of a dispatcher process (see RunDispatcherProcess).
const (
	EnvDispatcherDSN = "PAYMENTS_DISPATCHER_DSN"
	EnvRailURL       = "PAYMENTS_RAIL_URL"
)

// RunDispatcherProcess is the body of a dispatcher process: it connects
// with the DSN in PAYMENTS_DISPATCHER_DSN (a login role in
// modkit_outbox_dispatcher), dispatches to the rail at PAYMENTS_RAIL_URL,
// prints "ready" once started, and runs until stdin closes.
func RunDispatcherProcess(ctx context.Context, stdin io.Reader, stdout io.Writer, logger *slog.Logger) error {
	dsn, railURL := os.Getenv(EnvDispatcherDSN), os.Getenv(EnvRailURL)
	if dsn == "" || railURL == "" {
		return fmt.Errorf("dispatcher process: %s and %s must be set", EnvDispatcherDSN, EnvRailURL)
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	client, err := outbox.New(outboxpg.New(pool), outbox.Config{Logger: logger})
	if err != nil {
		return err
	}
	httpClient := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: RailConcurrency}}
	defer httpClient.CloseIdleConnections()
	d, err := client.NewDispatcher(DispatcherConfig(logger), RailPublisher(railURL, httpClient))
	if err != nil {
		return err
	}
	if err := d.Start(ctx); err != nil {
		return err
	}
	if _, err := fmt.Fprintln(stdout, "ready"); err != nil {
		_ = d.Stop(context.Background())
		return err
	}
	_, _ = io.Copy(io.Discard, stdin)
	return d.Stop(context.Background())
}
