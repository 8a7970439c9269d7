// Package outboxtest helps a module test what it puts in the outbox,
// against a real PostgreSQL, without reading the outbox's tables itself.
//
//   - Main (from TestMain) and NewDB / NewClient: a freshly migrated
//     database per test, on the server in TEST_DATABASE_URL or DATABASE_URL
//     (the role needs CREATEDB), or on a throwaway PostgreSQL started from
//     the local server binaries when neither is set.
//   - RequireEnqueued / RequireEnqueuedTx, RequireEnqueuedOnce /
//     RequireEnqueuedOnceTx and RequireNotEnqueued / RequireNotEnqueuedTx:
//     assert that a topic has an event (at least one, or exactly one) or
//     has none, optionally matching its payload, dedupe key, tenant,
//     ordering key or headers; the Tx forms
//     look inside the caller's uncommitted transaction. A topic with an
//     empty namespace or topic (such as the zero Topic an uninitialised
//     TypedTopic returns) fails the test at once, in these and in Drain:
//     it would match every topic.
//   - Recorder: a capturing publisher.
//   - Drain: runs a dispatcher until the outbox has nothing left to deliver
//     for the given publishers, and returns what they published; an event
//     that keeps failing is dead after three attempts, or after the app's
//     number with DrainWith (DrainOptions: MaxAttempts, Retry). What it
//     dead-letters, and its dispatcher's errors (a publisher's panic, with
//     the stack), go to the test's log.
//
// A nil *outbox.Client fails the test, saying so, in every helper that
// takes one.
//
// A module's test:
//
//	func TestMain(m *testing.M) { outboxtest.Main(m) }
//
//	func TestPlaceOrder(t *testing.T) {
//		client, tdb := outboxtest.NewClient(t, outbox.Config{})
//		orders := NewOrders(tdb.Provider, client)
//		if err := orders.Place(ctx, "o-1"); err != nil {
//			t.Fatal(err)
//		}
//		outboxtest.RequireEnqueuedOnce(t, client, OrderPlaced.Topic(), outboxtest.Payload(OrderPlacedEvent{OrderID: "o-1"}))
//		rec := outboxtest.NewRecorder()
//		delivered := outboxtest.Drain(t, client, rec.Publisher(OrderPlaced.Topic()))
//		…
//	}
package outboxtest
