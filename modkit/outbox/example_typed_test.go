package outbox_test

import (
	"context"
	"fmt"

	"github.com/modkit-go/modkit/modkit/outbox"
)

type InvoiceIssued struct {
	InvoiceID string `json:"invoice_id"`
	Cents     int64  `json:"cents"`
}

// Declare a topic with its payload type once; producers enqueue a value,
// the publisher receives it decoded (and the raw JSON).
func ExampleTypedTopic() {
	tdb, client, done := exampleDB()
	defer done()
	ctx := context.Background()
	invoiceIssued := outbox.NewTypedTopic[InvoiceIssued]("billing", "invoice_issued")

	if _, err := invoiceIssued.Enqueue(ctx, client, tdb.Provider.Pool, InvoiceIssued{InvoiceID: "inv-7", Cents: 4200}); err != nil {
		panic(err)
	}

	got := make(chan outbox.TypedDelivery[InvoiceIssued], 1)
	d, err := client.NewDispatcher(outbox.DispatcherConfig{Logger: quietLog},
		invoiceIssued.Publisher(func(_ context.Context, d outbox.TypedDelivery[InvoiceIssued]) error {
			got <- d
			return nil
		}))
	if err != nil {
		panic(err)
	}
	if err := d.Start(ctx); err != nil {
		panic(err)
	}
	defer func() { _ = d.Stop(ctx) }()
	delivery := <-got
	fmt.Println(delivery.Value.InvoiceID, delivery.Value.Cents, string(delivery.Payload))
	// Output: inv-7 4200 {"cents": 4200, "invoice_id": "inv-7"}
}
