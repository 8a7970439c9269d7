// Package outbox is a transactional outbox on PostgreSQL: commit a change
// and reliably tell someone about it.
//
// A module writes its domain rows and an event in one transaction, through
// whatever it already uses (a pgx.Tx as it is; a bun or database/sql
// transaction wrapped with db.SQL). A Dispatcher, run as
// a lifecycle task in an fx app (see Module) or on its own, claims due events
// in batches under a lease, hands each to the Publisher that the owning
// module registered for its (namespace, topic), and records the outcome:
// delivered; retried with exponential backoff and equal jitter; or
// dead-lettered after DispatcherConfig.MaxAttempts.
//
// # Example
//
//	client, err := outbox.New(outboxpg.New(pool), outbox.Config{}) // once per process
//	err = client.Migrate(ctx)                                       // or run migrations/ with your own tool
//
//	// In the domain transaction:
//	err = db.InTx(ctx, pool, func(ctx context.Context, tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, "UPDATE turns SET state = 'completed' WHERE id = $1", turnID); err != nil {
//			return err
//		}
//		_, err := client.Enqueue(ctx, tx, outbox.Message{
//			Namespace: "mini-chat", Topic: "usage_snapshot",
//			TenantID: &tenantID, DedupeKey: outbox.Key(tenantID.String() + "/" + turnID.String()),
//			Payload: payload,
//		})
//		return err
//	})
//
//	// At start-up:
//	d, err := client.NewDispatcher(outbox.DispatcherConfig{}, outbox.Publisher{
//		Topic: outbox.Topic{Namespace: "mini-chat", Topic: "usage_snapshot"}, Publish: sendToBilling})
//	err = d.Start(ctx) // … d.Stop(ctx) at shutdown
//
// In an fx app, Module provides the Client and runs the dispatcher, and
// WithMigrations migrates before anything built on the Client (the
// dispatcher included) starts. TypedTopic binds a topic
// to a Go payload type on both sides. Package outboxtest holds the helpers
// for a module's tests (RequireEnqueued, Drain, a per-test database).
//
// # Guarantees
//
//   - Completeness: an event enqueued in a transaction is committed with it or
//     not at all. Enqueue adds no network call beyond the INSERT itself
//     (and, when its dedupe key exists already, one more to find the
//     existing event).
//   - Idempotent enqueue: while a row with the same (namespace, topic,
//     dedupe_key) exists, enqueueing again inserts nothing and reports
//     Enqueued.AlreadyEnqueued with the existing id, also under races. The
//     dedupe window is the row's lifetime: delivered rows are purged after
//     their topic's retention, after which the key can be used again, or at
//     delivery under Publisher.DeleteOnDelivery.
//   - At-least-once delivery: an event is published until a publisher
//     returns nil and the outcome is recorded, or until it is dead. A crash
//     at any point leads to redelivery after the lease expires, with the
//     same ID and DedupeKey: consumers must be idempotent on them (or use
//     Publisher.HandleTx, below).
//   - Per-key order: events with the same Message.OrderingKey in one
//     namespace and topic are published one at a time in the order their
//     transactions committed (Delivery.Sequence, allocated in the
//     producer's transaction, gap-free). A key's next event is published
//     only after the previous one is delivered, by any dispatcher (one
//     claim may lease a run of a key's events, published one after
//     another; the rest go back unpublished when one fails); after a
//     crash the same event is delivered again before anything after it,
//     and a crash in the middle of such a run delivers the run's
//     unrecorded events again, in order, from the first (a consumer that
//     skips event IDs it has handled sees each key in order). A
//     dead event holds its key back (Admin.BlockedKeys) until it is
//     replayed, skipped (Admin.SkipHead) or purged (Admin.PurgeDead),
//     unless Publisher.SkipDeadHeads. One at a time holds for publishes
//     that return: one that ignores its context past its deadline is
//     abandoned (below), and its event is published again while the
//     abandoned call may still run.
//     Events without a key, and events of different keys, are not ordered.
//   - Fencing: every claim issues a fresh lease token, and an outcome is
//     recorded only with the current token of an unexpired lease held by
//     the same worker (WorkerID). A worker
//     that stalled past its lease (GC pause, network partition) changes
//     nothing; it never settles an event that another worker now owns.
//   - No double publishing under valid leases: claims use FOR UPDATE SKIP
//     LOCKED, so replicas never hold the same event at once; publish
//     contexts end LeaseHeadroom before the lease.
//   - Topic isolation: each topic has its own limit of publishes in flight
//     (Publisher.Concurrency). A publish that outlives its deadline is
//     abandoned: its slot is freed and its attempt counts as failed (retried
//     with backoff, so an event whose every publish hangs is dead-lettered
//     after MaxAttempts); a topic whose every slot is held by abandoned publishes is
//     paused until they return, and Dispatcher.Health reports it. Other
//     topics are not affected by one topic's hang: it holds at most its own
//     limit. The limits of all topics together may pass the dispatcher's
//     Concurrency (half of it each, by default), so a topic that already
//     has a publish in flight does not take the dispatcher's last free slot
//     while another topic has none in flight. Topics that hang together
//     therefore leave one slot, which the other topics share one publish at
//     a time. A topic's first slot may be the last one, so topics allowed
//     one slot each (every topic's default when Concurrency is below 4)
//     can still hold every slot when they hang together. Topics whose
//     publishes may hang together are best given lower limits, or a
//     dispatcher of their own. One limit this isolation has: a claim walks
//     the table's due events oldest first and passes over those of the
//     topics it leaves out (paused, full, or served by no dispatcher), so
//     a large backlog of a hung or slow topic slows the other topics'
//     claims, the more so with many topics registered (a trial: 200,000
//     waiting events took another topic's delivery from 2 ms to 58 ms at
//     the median; with 1,000 topics registered, to seconds). Keep such a
//     backlog small (a lower MaxAttempts, dead-lettering an unserved
//     topic's events), or give the topic a schema of its own.
//   - Exhausted events end dead, never stuck: a worker that dies on the last
//     allowed attempt leaves the row processing with attempts =
//     max_attempts, which no claim picks up; the topic's maintenance moves
//     it to dead with a last_error saying so.
//   - Maintenance (that sweep, the purge of delivered events after each
//     topic's retention, the depth gauges) runs for each topic on one
//     dispatcher at a time, elected through a lease row in the database.
//   - Exactly-once effects for consumers in the same database: a Publisher
//     with HandleTx gets a transaction in which its writes and the
//     delivered mark commit together.
//   - All times (next_attempt_at, leases, retention) come from the database
//     clock (Config.Now replaces it in tests).
//
// # Failure modes
//
//   - Not migrated: enqueues and dispatcher starts fail with an error
//     matching ErrNotMigrated that says how to migrate. Migrated by an
//     earlier version (the library upgraded, its new migrations not run):
//     a dispatcher's start logs a warning naming the missing migrations,
//     when the schema records them (the modkit migrator's table; not
//     golang-migrate's or goose's).
//   - Database unavailable: claims and outcome writes are retried with
//     capped backoff, and Health reports failing claims; events whose
//     outcomes could not be recorded before their lease ended are delivered
//     again, each expired lease counting as an attempt (see
//     DispatcherConfig.MaxAttempts: an outage longer than the lease costs
//     the events in flight an attempt, though their publishes succeeded).
//     A claim the claimer stopped waiting for (LeaseHeadroom) is not
//     cancelled: if it leases events, they are given back when it answers,
//     without using an attempt. A write that committed but whose answer was lost with the
//     connection is recognised when it is tried again (from the attempts
//     ledger, since migration 0035): its outcomes are reported as recorded,
//     not as leases lost.
//   - Lost notifications: LISTEN is only a wake-up. Polling every
//     PollInterval always runs, and a lost LISTEN connection is re-opened,
//     as is one that goes silent without an error (a proxy that keeps the
//     client's side open after the server's went away): after 30s without
//     a notification the listener sends itself one, and reconnects when it
//     is not back within 10s. Its connection is opened with the pool's
//     BeforeConnect and AfterConnect hooks.
//     Retries need neither: the dispatcher that scheduled one wakes itself
//     when it falls due.
//   - Publisher panics are recovered, logged with a stack, and count as a
//     failed attempt. So does a publisher that ends its goroutine with
//     runtime.Goexit (t.Fatal or t.FailNow in a publisher under test): a
//     new goroutine takes its place.
//   - A publisher that ignores its context: see topic isolation above. Its
//     goroutines are left running (at most twice its Concurrency) and
//     counted in Health.Abandoned and the outbox.publish.abandoned metric.
//   - Errors stored in last_error and logged are stripped of credentials
//     (Authorization headers, bearer tokens, passwords in URLs) and
//     truncated (Config.ErrorMaxLen).
//
// # Choosing Publish or HandleTx
//
// Use Publish for anything outside the database: a broker, a webhook, an
// in-process call. Use HandleTx when the consumer's effect is rows in the
// outbox's own database: its writes and the delivered mark commit together.
//
// # Operations
//
// Client.Admin has Stats (every status; it reads the delivered events
// kept) and Backlog (pending, processing and dead only, from their indexes:
// for dashboards and probes), List (pending, dead, … with filters and paging),
// Get, ReplayDead and PurgeDead (by id or filter), DeadLetter (pending
// events made dead: those of a topic no dispatcher serves), Purge,
// PruneSequences (the sequence rows of ordering keys without events, which
// the database otherwise keeps for every key ever used), Series
// (throughput and delivery latency per bucket, for charts) and Settled
// (recent outcomes, to follow deliveries). Dispatcher.Health says whether a
// dispatcher is ready (its first claim succeeded) and whether it is
// degraded, and why; outboxui.HealthHandler serves it to probes.
//
// The command modkit-outbox (go install
// github.com/modkit-go/modkit/cmd/modkit-outbox@latest) drives Admin from
// the shell: migrate, stats, events list/show, dead replay/purge/skip-head/letter,
// purge, tail, and serve, which runs the dashboard of package
// modkit/outbox/outboxui. That dashboard is an http.Handler you can also
// mount in your own server.
//
// # Least privilege, history and tracing
//
// Every read and write of the PostgreSQL driver calls a SECURITY DEFINER
// function with a pinned search_path, with one exception: a producer
// inserts new events without an ordering key itself (a plain INSERT, or
// COPY for a batch of 64 or more through pgx), into the message columns
// only, which the table's checks guard as the functions do. The roles modkit_outbox_producer,
// modkit_outbox_dispatcher, modkit_outbox_operator and modkit_outbox_reader
// may each call only what their job needs (the README's "Least privilege"
// lists them). Recording an outcome checks the lease token, the worker and
// the lease's expiry; a transactional handler whose lease was lost fails
// with ErrLeaseLost and its transaction rolls back. Each outcome, lease
// repair, sweep, replay, skipped dead head, dead-lettered event
// (Admin.DeadLetter) and operator's purge (Admin.Purge, Admin.PurgeDead) appends an entry to the event's history,
// an append-only ledger that Admin.History reads.
//
// Message.Headers travel to Delivery.Headers. Enqueue adds the W3C trace
// context (traceparent, tracestate) of its ctx and records an "outbox
// enqueue" span; the dispatcher restores that context into the publish ctx
// under an "outbox publish" span, so one trace covers the request that
// committed the event and every attempt to publish it (spans go to the
// global TracerProvider, otel.SetTracerProvider). A publish span starts
// with messaging.system, messaging.operation.type and
// messaging.destination.name ("namespace:topic"), which a sampler sees; a
// span that records also gets messaging.message.id and
// modkit_outbox.attempt. The broker adapters send Delivery.Headers as they
// are, so the traceparent a consumer reads is the enqueue's (the message's
// creation context, as OpenTelemetry's messaging conventions have it): its
// span is a sibling of the publish spans, not a child of one.
//
// # Metrics
//
// A running Dispatcher reports OpenTelemetry metrics through the global
// MeterProvider (otel.SetMeterProvider), instrumentation scope
// "github.com/modkit-go/modkit/modkit/outbox". Attributes: namespace and
// topic (the event's), worker_id (the dispatcher's DispatcherConfig.WorkerID).
// The Prometheus name is the one the OpenTelemetry Prometheus exporter
// derives: dots become underscores, counters end in _total, and
// instruments in seconds end in _seconds. The unit column says what is
// counted; only the instruments in s declare a unit (metric.WithUnit), the
// others declare none.
//
//	name (Prometheus name)                                      kind        unit     attributes
//	outbox.events.delivered (outbox_events_delivered_total)     counter     events   namespace, topic
//	outbox.events.retried (outbox_events_retried_total)         counter     events   namespace, topic
//	outbox.events.dead (outbox_events_dead_total)               counter     events   namespace, topic
//	outbox.events.released (outbox_events_released_total)       counter     events   namespace, topic
//	outbox.events.lease_lost (outbox_events_lease_lost_total)   counter     events   namespace, topic
//	outbox.events.unrecorded (outbox_events_unrecorded_total)   counter     events   namespace, topic
//	outbox.publish.abandoned (outbox_publish_abandoned_total)   counter     calls    namespace, topic
//	outbox.claim.errors (outbox_claim_errors_total)             counter     queries  none
//	outbox.listener.reconnects (outbox_listener_reconnects_total)
//	                                                            counter     reconnects none
//	outbox.claim.batches (outbox_claim_batches_total)           counter     claims   namespace, topic
//	outbox.claim.events (outbox_claim_events_total)             counter     events   namespace, topic
//	outbox.lease.repairs (outbox_lease_repairs_total)           counter     leases   namespace, topic
//	outbox.wakeups (outbox_wakeups_total)                       counter     notifications namespace, topic
//	outbox.publish.duration (outbox_publish_duration_seconds)   histogram   s        namespace, topic
//	outbox.delivery.lag (outbox_delivery_lag_seconds)           histogram   s        namespace, topic
//	outbox.pending.depth (outbox_pending_depth)                 gauge       events   namespace, topic
//	outbox.processing.depth (outbox_processing_depth)           gauge       events   namespace, topic
//	outbox.dead.count (outbox_dead_count)                       gauge       events   namespace, topic
//	outbox.pending.oldest_age (outbox_pending_oldest_age_seconds)
//	                                                            gauge       s        namespace, topic
//	outbox.stuck.depth (outbox_stuck_depth)                     gauge       events   namespace, topic
//	outbox.dispatcher.degraded (outbox_dispatcher_degraded)     gauge       0 or 1   worker_id
//
// What they measure:
//
//   - delivered, retried, dead: outcomes recorded (dead counts both events
//     dead-lettered by a publish and those the maintenance sweep moved to
//     dead after their last attempt). released: claimed events given back unpublished
//     (stop, deadline passed while queued, a publish still running when a
//     stop ran out of time), without using an attempt; a publish abandoned
//     at its deadline counts as retried or dead. lease_lost: outcomes refused because the lease had
//     expired (another dispatcher may publish the event again).
//     unrecorded: outcomes the dispatcher gave up writing (the database
//     unavailable until their leases ended, or a stop that ran out of
//     time); OnOutcome is not called for them, and their events are
//     published again.
//   - publish.abandoned: publish calls abandoned because they outlived their
//     deadline (see Topic isolation) or had not returned when a stop ran
//     out of time.
//   - claim.errors: failed claim queries; listener.reconnects: LISTEN
//     connections lost (or found silent: no notification, not even the
//     listener's own check, for 40s) after they listened; failed attempts
//     to reconnect are logged, not counted.
//   - claim.batches: claims that leased at least one event of the topic;
//     claim.events: the events they leased. lease.repairs: expired leases
//     repaired by a claim or the sweeper (a dispatcher crashed or overran;
//     each is a lease_expired entry in the event's history). A lease that
//     expired on the event's last attempt is not repaired: the sweeper
//     buries the event, which dead counts (its history has the
//     lease_expired entry too). wakeups:
//     enqueue notifications received for a topic this dispatcher serves.
//   - publish.duration: the time of each Publish or HandleTx call (not
//     recorded for abandoned calls). delivery.lag: from the event's enqueue
//     (its transaction's start, created_at) to its successful publish;
//     queueing and retries included. created_at is the database's clock;
//     the dispatcher moves it to its own by the database clock's lead that
//     its claims show (a lease ends at the database's time at the claim's
//     start plus LeaseDuration; the smallest reading of the last 64
//     claims), so skew between the hosts does not shift the lags. Their buckets are in seconds, from
//     1 ms to 60 s and to 1 h (a MeterProvider view may set others).
//   - The gauges are read from the table by the one dispatcher that holds a
//     topic's maintenance lease (only topics with a running dispatcher are
//     reported): at each maintenance pass (SweepInterval, 30s by default)
//     and, in between, about a second after its claims, outcomes or
//     enqueue notifications change them; while a topic has pending or
//     processing events they are read every second (less often if reading
//     them is slow: at most 1/20 of one connection's time), and an idle
//     topic costs no reads. So they trail the table by about a second;
//     only a change to an idle topic that this dispatcher neither makes nor
//     hears of (an operator's replay that another dispatcher then
//     delivers) waits for the next pass. pending.depth counts pending events (due or not),
//     processing.depth leased ones, dead.count dead ones;
//     pending.oldest_age is how long the oldest due pending event has
//     waited past its next_attempt_at (0 when none is due), counting an
//     event held behind an earlier one of its ordering key as due from its
//     own next_attempt_at: it grows while a key waits for its head (a
//     retry, a dead head), which is what an alert on it should catch;
//     stuck.depth counts leased events whose lease expired without an
//     outcome, waiting for a claim or the sweeper to repair them. A read
//     of the gauges that fails drops them (they are not reported until a
//     read succeeds, rather than reported stale) and counts as failing
//     maintenance in Health.
//   - The attributes carry no schema: two outboxes of one process (two
//     schemas) with the same namespace and topic share their series. Give
//     them different namespaces to tell them apart.
//   - dispatcher.degraded is 1 while Dispatcher.Health reports Degraded.
//
// To export them to Prometheus, install the OpenTelemetry Prometheus
// exporter as the global MeterProvider before starting dispatchers:
//
//	exporter, err := prometheus.New() // go.opentelemetry.io/otel/exporters/prometheus
//	if err != nil { … }
//	otel.SetMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter)))
//	http.Handle("/metrics", promhttp.Handler()) // github.com/prometheus/client_golang/prometheus/promhttp
//
// and alert, for example, on outbox_pending_oldest_age_seconds above your
// delivery objective, on increase(outbox_events_dead_total[15m]) > 0, or on
// outbox_dispatcher_degraded == 1.
//
// # Engines
//
// The client talks to its database through a driver (package
// modkit/outbox/driver); outboxpg is the PostgreSQL one. Enqueues run
// through the caller's own transaction whatever library opened it.
package outbox
