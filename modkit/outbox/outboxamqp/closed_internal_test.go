package outboxamqp

import (
	"errors"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// A publish whose channel closed before its confirmation is retried, with
// the broker's reason in its error; the message whose size made the broker
// close it (over max_message_size) is permanent, while the others failed
// with it are retried.
func TestChannelClosedError(t *testing.T) {
	tooLarge := &amqp.Error{Code: amqp.PreconditionFailed,
		Reason: "PRECONDITION_FAILED - message size 135266304 is larger than configured max size 134217728"}
	for _, c := range []struct {
		name      string
		reason    *amqp.Error
		body      int
		permanent bool
		says      string
	}{
		{"no reason", nil, 10, false, "the channel closed first"},
		{"a missing exchange", &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no exchange 'x' in vhost '/'"}, 10, false, "404 NOT_FOUND - no exchange"},
		{"the message over max_message_size", tooLarge, 135266304, true, "max_message_size"},
		{"another message on the channel it closed", tooLarge, 10, false, "message size 135266304 is larger"},
		{"another precondition", &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - unknown delivery tag 1"}, 135266304, false, "unknown delivery tag"},
	} {
		err := channelClosedError(c.reason, "ex", "key", c.body)
		if !errors.Is(err, ErrNotConfirmed) || outbox.IsPermanent(err) != c.permanent || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v (permanent %v); want ErrNotConfirmed, permanent %v, saying %q", c.name, err, outbox.IsPermanent(err), c.permanent, c.says)
		}
	}
}
