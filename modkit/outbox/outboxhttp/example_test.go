package outboxhttp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxhttp"
)

// A receiver verifies each webhook, then reads which event it carries.
func ExampleVerifier_Middleware() {
	v, err := outboxhttp.NewVerifier(outboxhttp.VerifierConfig{Secrets: []string{"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}})
	if err != nil {
		panic(err)
	}
	receiver := v.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ev, err := outboxhttp.EventOf(r.Header) // not signed: see the package doc
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body, _ := io.ReadAll(r.Body) // verified
		fmt.Printf("%s/%s key %q #%d: %s\n", ev.Namespace, ev.Topic, ev.OrderingKey, ev.Sequence, body)
	}))

	srv := httptest.NewServer(receiver)
	defer srv.Close()
	pub, _ := outboxhttp.New(outboxhttp.Config{Endpoint: srv.URL, Secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"})
	defer pub.Close()
	err = pub.Publish(context.Background(), outbox.Delivery{ID: uuid.New(), Namespace: "shop", Topic: "order_paid",
		OrderingKey: "client 7", Sequence: 1, Payload: json.RawMessage(`{"order":42}`)})
	fmt.Println(err)
	// Output:
	// shop/order_paid key "client 7" #1: {"order":42}
	// <nil>
}
