// Package outboxkafka publishes outbox events to Apache Kafka through a
// franz-go client (github.com/twmb/franz-go/pkg/kgo).
//
// Each event becomes one record: on the topic "<namespace>.<topic>"
// (Config.Topic overrides it), keyed by Config.Key, with the payload as
// value, the event's headers as record headers, and the event id in the
// header "outbox-event-id" (HeaderEventID) for consumers to de-duplicate
// on.
//
// # Example
//
//	cl, _ := kgo.NewClient(kgo.SeedBrokers("localhost:9092"), kgo.ProducerLinger(0))
//	defer cl.Close()
//	pub, _ := outboxkafka.New(cl, outboxkafka.Config{})
//	d, _ := client.NewDispatcher(outbox.DispatcherConfig{}, pub.For(outbox.Topic{Namespace: "billing", Topic: "invoice_paid"}))
//
// # Guarantees
//
// New refuses a client whose idempotent writes are disabled; franz-go's
// idempotent producer requires acks from all in-sync replicas, so a
// publish returns nil only once every in-sync replica has the record, and the broker drops the copies of a
// produce request that the client re-sends after a network error. That
// de-duplication lives inside one producer session: a record that the
// outbox delivers again (after a dispatcher crash, a lost outcome or a
// publish abandoned at its deadline) is a second record with the same
// outbox-event-id header. Consumers must de-duplicate on it.
//
// # Failures
//
// A topic not created yet, an unreachable broker or a missing
// acknowledgement is an error to retry. So is a topic deleted and created
// again, whose new id the client learns for the next attempt. A record
// that the client refuses as too large (kgo.ProducerBatchMaxBytes,
// kgo.MaxBufferedBytes) is wrapped in outbox.Permanent, since no retry can
// change it. The broker's "too large" answers a whole batch
// (records of other events published at the same moment share it), so it
// is retried for a record under the client's limit; keep
// ProducerBatchMaxBytes at most the topic's max.message.bytes so that
// batches are not refused. The broker's "invalid record" (a record without
// a key on a compacted topic, say) answers a whole batch too, and is
// retried: the others go through in another batch, and the invalid record
// is dead-lettered after its attempts. Permanent too is an event mapped to
// a topic name that Kafka refuses (see ErrInvalidTopic), which is not
// produced: Publish checks the name first, because a broker can answer for
// such a name as for a topic not created yet (kfake does), and the event
// would be retried until it ran out of attempts. New checks the client's
// default produce topic; it cannot check Config.Topic, a function of the
// event.
//
// # Keys and partitions
//
// The record key chooses the partition, and so what keeps its order in
// Kafka. DefaultKey uses the event's ordering key (Message.OrderingKey,
// whose events the outbox publishes one at a time, in order: one
// partition keeps that order for consumers), then the tenant id, then the
// dedupe key, and leaves events with none unkeyed. Set Config.Key for
// another choice.
//
// # Batching and linger
//
// The dispatcher publishes events concurrently, and the franz-go client
// gathers the records produced while a request is on its way into one
// produce request per partition; each publish still waits for its own
// record's acknowledgement. A publish also waits out the client's linger
// (kgo.ProducerLinger, 10ms by default) before its record is sent, so with
// the dispatcher's 32 publishes in flight the default linger caps a topic
// near 32 records per 10ms. Give the client kgo.ProducerLinger(0): batches
// still form from the concurrent publishes. Measured on the in-process
// kfake cluster (BenchmarkPublish, 2 shared cores): 32 in flight, 2,856
// events/s with the default linger and 80,120 with none; 1 in flight, 91
// and 8,904.
package outboxkafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// HeaderEventID is the record header holding the event id.
const HeaderEventID = "outbox-event-id"

// Config configures a Publisher. The zero Config is valid.
type Config struct {
	// Topic maps an event to its Kafka topic. Default: DefaultTopic.
	Topic func(d outbox.Delivery) string
	// Key maps an event to its record key (nil for none). Default:
	// DefaultKey.
	Key func(d outbox.Delivery) []byte
}

// DefaultTopic is "<namespace>.<topic>", e.g. "billing.invoice_paid".
// Kafka topic names are at most 249 characters of [a-zA-Z0-9._-]; the
// outbox's names fit unless namespace and topic together pass that length,
// and an event whose names do fails permanently with ErrInvalidTopic.
func DefaultTopic(d outbox.Delivery) string { return d.Namespace + "." + d.Topic }

// DefaultKey is the event's ordering key, or else its tenant id (its
// hyphenated string), or else its dedupe key, or else nil (no key: the
// client spreads such records over the partitions).
func DefaultKey(d outbox.Delivery) []byte {
	switch {
	case d.OrderingKey != "":
		return []byte(d.OrderingKey)
	case d.TenantID != nil:
		return []byte(d.TenantID.String())
	case d.DedupeKey != nil:
		return []byte(*d.DedupeKey)
	}
	return nil
}

// ErrNotAcknowledged is returned (wrapped) when Kafka did not acknowledge
// a record: the publish is retried unless the error is permanent.
var ErrNotAcknowledged = errors.New("outboxkafka: record not acknowledged by Kafka")

// ErrInvalidTopic is returned (wrapped, and wrapped in outbox.Permanent)
// by Publish when the event maps to a topic name that Kafka refuses: empty,
// longer than 249 characters, with a character other than ASCII letters,
// digits, '.', '_' and '-', or "." or "..". The record is not produced.
// The message says which rule the name breaks. New returns it too, with
// outbox.ErrInvalidConfig, for such a default produce topic of the client.
var ErrInvalidTopic = errors.New("outboxkafka: not a valid Kafka topic name")

// topicMaxLen is the longest topic name Kafka accepts.
const topicMaxLen = 249

// checkTopic returns why Kafka refuses the topic name, or "".
func checkTopic(name string) string {
	switch {
	case name == "":
		return "it is empty"
	case name == "." || name == "..":
		return `Kafka refuses "." and ".."`
	}
	for i, c := range name {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Sprintf("it contains %q (at byte %d); Kafka allows only ASCII letters, digits, '.', '_' and '-'", c, i)
		}
	}
	if len(name) > topicMaxLen {
		return fmt.Sprintf("it is %d characters long; Kafka allows at most %d", len(name), topicMaxLen)
	}
	return ""
}

// Publisher produces outbox events to Kafka. It is safe for concurrent use
// and does not own the client: close it when the dispatchers have
// stopped.
type Publisher struct {
	cl    *kgo.Client
	topic func(outbox.Delivery) string
	key   func(outbox.Delivery) []byte
	// defaultTopic is the client's kgo.DefaultProduceTopic ("" without
	// one), which it produces a record with an empty topic to, and every
	// record to when alwaysDefault (kgo.DefaultProduceTopicAlways).
	defaultTopic  string
	alwaysDefault bool
	// batchMax is the client's kgo.ProducerBatchMaxBytes: a record over
	// it can never be produced.
	batchMax int

	forgotMu sync.Mutex
	forgot   map[string]time.Time // when forgetTopic last made the client forget each topic
}

// New returns a Publisher producing through cl. It fails with an error
// matching outbox.ErrInvalidConfig if cl has idempotent writes disabled
// (kgo.DisableIdempotentWrite), is transactional (kgo.TransactionalID: it
// would refuse every record produced outside a transaction), stops
// producing for good on data loss (kgo.StopProducerOnDataLossDetected) or
// flushes by
// hand only (kgo.ManualFlushing: records would wait for a Flush nobody
// calls), or has a default produce topic
// (kgo.DefaultProduceTopic) that Kafka refuses (the error then matches
// ErrInvalidTopic too). Config.Topic, a function of the event, is checked
// by Publish.
func New(cl *kgo.Client, cfg Config) (*Publisher, error) {
	if cl == nil {
		return nil, fmt.Errorf("%w: outboxkafka: the client is nil", outbox.ErrInvalidConfig)
	}
	if off, _ := cl.OptValue(kgo.DisableIdempotentWrite).(bool); off {
		return nil, fmt.Errorf("%w: outboxkafka: the client has idempotent writes disabled (kgo.DisableIdempotentWrite)", outbox.ErrInvalidConfig)
	}
	if v := cl.OptValues(kgo.TransactionalID); len(v) > 1 && v[1] == true {
		return nil, fmt.Errorf("%w: outboxkafka: the client is transactional (kgo.TransactionalID), and refuses records "+
			"produced outside a transaction; give the publisher a client of its own without it", outbox.ErrInvalidConfig)
	}
	if stop, _ := cl.OptValue(kgo.StopProducerOnDataLossDetected).(bool); stop {
		return nil, fmt.Errorf("%w: outboxkafka: the client stops producing for good when it detects data loss "+
			"(kgo.StopProducerOnDataLossDetected): after one such answer every publish would fail until the process restarts, "+
			"and the outbox dead-letters what it cannot publish; give the publisher a client without it", outbox.ErrInvalidConfig)
	}
	if manual, _ := cl.OptValue(kgo.ManualFlushing).(bool); manual {
		return nil, fmt.Errorf("%w: outboxkafka: the client flushes by hand only (kgo.ManualFlushing): a publish would wait "+
			"for a Flush nobody calls; give the publisher a client without it", outbox.ErrInvalidConfig)
	}
	def, _ := cl.OptValue(kgo.DefaultProduceTopic).(string)
	if why := checkTopic(def); def != "" && why != "" {
		return nil, fmt.Errorf("%w: %w: the client's default produce topic %q (kgo.DefaultProduceTopic): %s", outbox.ErrInvalidConfig, ErrInvalidTopic, def, why)
	}
	always, _ := cl.OptValue(kgo.DefaultProduceTopicAlways).(bool)
	if cfg.Topic == nil {
		cfg.Topic = DefaultTopic
	}
	if cfg.Key == nil {
		cfg.Key = DefaultKey
	}
	batchMax, _ := cl.OptValue(kgo.ProducerBatchMaxBytes).(int32)
	return &Publisher{cl: cl, topic: cfg.Topic, key: cfg.Key, defaultTopic: def, alwaysDefault: always && def != "",
		batchMax: int(batchMax)}, nil
}

// For returns the outbox.Publisher of topic, for NewDispatcher.
func (p *Publisher) For(topic outbox.Topic) outbox.Publisher {
	return outbox.Publisher{Topic: topic, Name: "outboxkafka " + topic.String(), Publish: p.Publish}
}

// Record builds the record of d: topic, key, value and headers (the
// event's, sorted by name, then HeaderEventID; an event header of that
// name is left out, so that the one consumers de-duplicate on is the
// outbox's own).
func (p *Publisher) Record(d outbox.Delivery) *kgo.Record {
	r := &kgo.Record{Topic: p.topic(d), Key: p.key(d), Value: d.Payload}
	names := make([]string, 0, len(d.Headers))
	for k := range d.Headers {
		if k != HeaderEventID {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	r.Headers = make([]kgo.RecordHeader, 0, len(names)+1)
	for _, k := range names {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(d.Headers[k])})
	}
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderEventID, Value: []byte(d.ID.String())})
	return r
}

// Publish produces d's record and waits for its acknowledgement or the end
// of ctx. Records refused for their size or topic name are permanent
// errors; a topic name that Kafka would refuse is not produced, and
// Publish returns ErrInvalidTopic wrapped in outbox.Permanent.
func (p *Publisher) Publish(ctx context.Context, d outbox.Delivery) error {
	r := p.Record(d)
	// The client produces a record without a topic to its default topic
	// (checked by New), and every record when told to always.
	if !p.alwaysDefault && (r.Topic != "" || p.defaultTopic == "") {
		if why := checkTopic(r.Topic); why != "" {
			return outbox.Permanent(fmt.Errorf("%w: topic %q of event %s (%s): %s; map the event to a valid name with Config.Topic "+
				"(DefaultTopic joins namespace and topic with '.', so they must fit in %d characters together), then replay it",
				ErrInvalidTopic, r.Topic, d.ID, outbox.Topic{Namespace: d.Namespace, Topic: d.Topic}, why, topicMaxLen-1))
		}
	}
	done := make(chan error, 1)
	p.cl.Produce(ctx, r, func(_ *kgo.Record, err error) { done <- err })
	select {
	case err := <-done:
		if err == nil {
			return nil
		}
		if errors.Is(err, kerr.UnknownTopicID) {
			p.forgetTopic(r.Topic)
		}
		err = fmt.Errorf("%w: topic %q: %w", ErrNotAcknowledged, r.Topic, err)
		if p.isPermanent(err, r) {
			return outbox.Permanent(err)
		}
		return err
	case <-ctx.Done():
		// An in-flight record of an idempotent producer cannot be
		// withdrawn; its outcome is dropped and the event retried.
		return fmt.Errorf("%w: topic %q: %w", ErrNotAcknowledged, r.Topic, context.Cause(ctx))
	}
}

// isPermanent reports whether producing r failed in a way no retry can
// change. A broker's "too large" answers a whole batch, which holds the
// records of other events published at the same time (franz-go fails
// each record of a refused batch with it): it is permanent only for a
// record over the client's batch limit, which can never be produced;
// another is retried, in a batch of its own or a smaller one, and dead
// after its attempts if it is over the topic's limit by itself. "Invalid
// record" (a record without a key on a compacted topic, say) also answers
// a whole batch, naming the offending records in a list franz-go does not
// read, so it is retried too: the others go through in a batch without
// the invalid one, which dies after its attempts.
func (p *Publisher) isPermanent(err error, r *kgo.Record) bool {
	switch {
	case errors.Is(err, kerr.MessageTooLarge):
		// franz-go refuses by itself a record too large for its limits
		// (kgo.ProducerBatchMaxBytes, which it compares with the encoded
		// batch, a few dozen bytes more than the record; and
		// kgo.MaxBufferedBytes), and says so without the batch's
		// compressed size, which a broker's answer carries.
		return p.batchMax > 0 && recordBytes(r) >= p.batchMax || !strings.Contains(err.Error(), ", compressed_bytes=")
	case errors.Is(err, kerr.RecordListTooLarge): // only a broker says this, of a whole batch
		return p.batchMax > 0 && recordBytes(r) >= p.batchMax
	case errors.Is(err, kerr.InvalidTopicException):
		return true
	}
	return false
}

// forgetTopic makes the client forget what it knows of topic (its id
// above all), at most once a second. A topic deleted and created again
// has a new id, and franz-go fails every record of it with
// UNKNOWN_TOPIC_ID until told to forget the old one: without this, each
// event of the topic ran out of attempts until the process restarted.
// Records of the topic buffered at that moment fail and are retried.
func (p *Publisher) forgetTopic(topic string) {
	p.forgotMu.Lock()
	now := time.Now()
	if last, ok := p.forgot[topic]; ok && now.Sub(last) < time.Second {
		p.forgotMu.Unlock()
		return
	}
	if p.forgot == nil {
		p.forgot = map[string]time.Time{}
	}
	p.forgot[topic] = now
	p.forgotMu.Unlock()
	p.cl.PurgeTopicsFromClient(topic)
}

// recordBytes is what r holds: its key, value and headers (less than its
// encoding, which adds a few bytes of lengths and offsets).
func recordBytes(r *kgo.Record) int {
	n := len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}
