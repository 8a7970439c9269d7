package outboxkafka_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/internal/brokertest"
	"github.com/modkit-go/modkit/modkit/outbox/outboxkafka"
	"github.com/modkit-go/modkit/modkit/outbox/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

var ctx = context.Background()

const (
	kafkaTopic = "test.events"
	addrsEnv   = "OUTBOXKAFKA_TEST_BROKERS" // the kfake cluster, for the crash child
)

// startCluster runs an in-process kfake cluster with the test topic, one
// partition, closed when the test ends.
func startCluster(t testing.TB, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1), kfake.SeedTopics(1, kafkaTopic)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// newClient opens a franz-go client on addrs without linger (as the
// package doc advises), closed when the test ends.
func newClient(t testing.TB, addrs []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(addrs...), kgo.ProducerLinger(0)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func newPublisher(t testing.TB, cl *kgo.Client, cfg outboxkafka.Config) *outboxkafka.Publisher {
	t.Helper()
	p, err := outboxkafka.New(cl, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// readAll consumes the test topic from the start until it has read up to
// the partition's high watermark and holds at least want distinct event
// ids.
func readAll(t testing.TB, addrs []string, want int) []*kgo.Record {
	t.Helper()
	cl := newClient(t, addrs, kgo.ConsumeTopics(kafkaTopic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var out []*kgo.Record
	ids := map[string]bool{}
	caughtUp := false
	for len(ids) < want || !caughtUp {
		fetches := cl.PollFetches(pctx)
		if err := pctx.Err(); err != nil {
			t.Fatalf("read %d records (%d distinct ids), want %d ids: %v", len(out), len(ids), want, err)
		}
		for _, e := range fetches.Errors() {
			t.Fatalf("fetch: %v", e.Err)
		}
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			for _, r := range p.Records {
				out = append(out, r)
				ids[eventID(t, r).String()] = true
			}
			if n := len(p.Records); n > 0 {
				caughtUp = p.Records[n-1].Offset+1 == p.HighWatermark
			}
		})
	}
	return out
}

func header(r *kgo.Record, key string) (string, bool) {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

func eventID(t testing.TB, r *kgo.Record) uuid.UUID {
	t.Helper()
	s, _ := header(r, outboxkafka.HeaderEventID)
	id, err := uuid.Parse(s)
	if err != nil {
		t.Fatalf("record at offset %d without an event id: %v", r.Offset, err)
	}
	return id
}

// TestCrashChild is the dispatcher process of TestDeliveredThroughSIGKILL.
func TestCrashChild(t *testing.T) {
	brokertest.Child(t, func(t testing.TB) outbox.Publisher {
		return newPublisher(t, newClient(t, strings.Split(os.Getenv(addrsEnv), ",")), outboxkafka.Config{}).For(brokertest.Topic)
	})
}

// TestDeliveredThroughSIGKILL delivers 10,000 events (3,000 under -race; BROKERTEST_EVENTS)
// with a dispatcher process SIGKILLed a third of the way, then a survivor:
// the topic holds every event, and holds one twice only if the outbox
// published it more than once (Kafka's idempotence does not span producer
// sessions; consumers de-duplicate on outbox-event-id).
func TestDeliveredThroughSIGKILL(t *testing.T) {
	cluster := startCluster(t)
	addrs := cluster.ListenAddrs()
	c, db := outboxtest.NewClient(t, outbox.Config{})
	n := brokertest.Events(t)
	ids := brokertest.Enqueue(t, c, db, n)

	calls := brokertest.RunCrash(t, c, db, n, brokertest.Crash{ChildTest: "TestCrashChild", Env: []string{addrsEnv + "=" + strings.Join(addrs, ",")}},
		newPublisher(t, newClient(t, addrs), outboxkafka.Config{}).For(brokertest.Topic))

	got := map[uuid.UUID]int{}
	for _, r := range readAll(t, addrs, n) {
		got[eventID(t, r)]++
		var p struct{ N int }
		if err := json.Unmarshal(r.Value, &p); err != nil {
			t.Fatal(err)
		}
		if seq, _ := header(r, "x-seq"); seq != jsonInt(p.N) {
			t.Fatalf("record at offset %d: x-seq %q, value n %d", r.Offset, seq, p.N)
		}
	}
	brokertest.Check(t, ids, got, calls, false)
}

func jsonInt(n int) string { b, _ := json.Marshal(n); return string(b) }

// TestRecord: topic, key, value and headers of delivered events, with the
// default key (tenant, then dedupe key, then none) and a custom topic and
// key.
func TestRecord(t *testing.T) {
	cluster := startCluster(t, kfake.SeedTopics(1, "custom-topic"))
	addrs := cluster.ListenAddrs()
	cl := newClient(t, addrs)
	p := newPublisher(t, cl, outboxkafka.Config{})
	tenant := uuid.New()
	key := tenant.String() + "/k"
	cases := []struct {
		d       outbox.Delivery
		wantKey string
	}{
		{outbox.Delivery{TenantID: &tenant, DedupeKey: &key, OrderingKey: "order-42", Sequence: 1}, "order-42"},
		{outbox.Delivery{TenantID: &tenant, DedupeKey: &key}, tenant.String()},
		{outbox.Delivery{DedupeKey: outbox.Key("plain")}, "plain"},
		{outbox.Delivery{}, ""},
	}
	for i, tc := range cases {
		tc.d.ID, tc.d.Namespace, tc.d.Topic, tc.d.Payload = uuid.New(), "test", "events", json.RawMessage(`{"i":`+jsonInt(i)+`}`)
		tc.d.Headers = map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "b": "2", "a": "1"}
		if err := p.Publish(ctx, tc.d); err != nil {
			t.Fatal(err)
		}
		cases[i] = tc
	}
	recs := readAll(t, addrs, len(cases))
	if len(recs) != len(cases) {
		t.Fatalf("%d records, want %d", len(recs), len(cases))
	}
	for i, r := range recs {
		tc := cases[i]
		if eventID(t, r) != tc.d.ID || string(r.Key) != tc.wantKey || string(r.Value) != string(tc.d.Payload) {
			t.Errorf("record %d: id %s key %q value %s; want %s %q %s", i, eventID(t, r), r.Key, r.Value, tc.d.ID, tc.wantKey, tc.d.Payload)
		}
		var names []string
		for _, h := range r.Headers {
			names = append(names, h.Key)
		}
		if got := strings.Join(names, ","); got != "a,b,traceparent,outbox-event-id" {
			t.Errorf("record %d headers %s", i, got)
		}
	}

	// An event header named like the outbox's id header is left out: the
	// record carries one, the event's id.
	forged := p.Record(outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{outboxkafka.HeaderEventID: "forged"}})
	if n := len(forged.Headers); n != 1 || eventID(t, forged) == uuid.Nil || string(forged.Headers[0].Value) == "forged" {
		t.Fatalf("a record of an event with its own %s header: %v", outboxkafka.HeaderEventID, forged.Headers)
	}

	custom := newPublisher(t, cl, outboxkafka.Config{
		Topic: func(outbox.Delivery) string { return "custom-topic" },
		Key:   func(d outbox.Delivery) []byte { return []byte("k-" + d.Topic) },
	})
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
	if err := custom.Publish(ctx, d); err != nil {
		t.Fatal(err)
	}
	cons := newClient(t, addrs, kgo.ConsumeTopics("custom-topic"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	pctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	r := cons.PollRecords(pctx, 1).Records()
	if len(r) != 1 || string(r[0].Key) != "k-events" || eventID(t, r[0]) != d.ID {
		t.Fatalf("custom topic and key: got %v", r)
	}
}

// TestClientChecked: New refuses a client without idempotent writes (and
// franz-go refuses idempotence without acks from all in-sync replicas), a
// transactional one (it refuses records outside a transaction, which the
// publish retried until dead) and one that flushes by hand only (a publish
// waited for its deadline).
func TestClientChecked(t *testing.T) {
	cluster := startCluster(t)
	for name, opts := range map[string][]kgo.Opt{
		"without idempotent writes": {kgo.DisableIdempotentWrite(), kgo.RequiredAcks(kgo.LeaderAck())},
		"transactional":             {kgo.TransactionalID("outbox")},
		"flushing by hand":          {kgo.ManualFlushing()},
		"stopping on data loss":     {kgo.StopProducerOnDataLossDetected()},
	} {
		cl := newClient(t, cluster.ListenAddrs(), opts...)
		if _, err := outboxkafka.New(cl, outboxkafka.Config{}); !errors.Is(err, outbox.ErrInvalidConfig) {
			t.Errorf("%s: got %v, want ErrInvalidConfig", name, err)
		}
	}
	if _, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.RequiredAcks(kgo.LeaderAck())); err == nil {
		t.Error("franz-go accepted an idempotent producer with leader acks")
	}
}

// TestTooLargeIsPermanent: a record the client refuses as too large is a
// permanent failure: one over its batch limit, one just under it (the
// client compares the encoded batch, a few dozen bytes larger), and one
// over its buffer (kgo.MaxBufferedBytes).
func TestTooLargeIsPermanent(t *testing.T) {
	cluster := startCluster(t)
	batchLimited := newPublisher(t, newClient(t, cluster.ListenAddrs(), kgo.ProducerBatchMaxBytes(1024)), outboxkafka.Config{})
	bufferLimited := newPublisher(t, newClient(t, cluster.ListenAddrs(), kgo.MaxBufferedBytes(2000)), outboxkafka.Config{})
	for _, c := range []struct {
		name  string
		p     *outboxkafka.Publisher
		bytes int
	}{{"over the batch limit", batchLimited, 4000}, {"just under the batch limit", batchLimited, 1000}, {"over the buffer", bufferLimited, 3000}} {
		d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events"}
		d.Payload = json.RawMessage(`"` + strings.Repeat("x", c.bytes-2-len(outboxkafka.HeaderEventID)-36) + `"`)
		if err := c.p.Publish(ctx, d); !outbox.IsPermanent(err) || !errors.Is(err, kerr.MessageTooLarge) {
			t.Errorf("%s (a record of %d bytes): got %v, want a permanent MESSAGE_TOO_LARGE", c.name, c.bytes, err)
		}
	}
}

// TestTopicCreatedAgainIsPublished: a topic deleted and created again has
// a new id, and the client failed every record of it (UNKNOWN_TOPIC_ID)
// until the process restarted, so each event of the topic ran out of
// attempts. A failed attempt now makes it learn the new id: one of the
// next few attempts goes through.
func TestTopicCreatedAgainIsPublished(t *testing.T) {
	cluster := startCluster(t)
	p := newPublisher(t, newClient(t, cluster.ListenAddrs()), outboxkafka.Config{Topic: func(outbox.Delivery) string { return kafkaTopic }})
	publish := func() error {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return p.Publish(c, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)})
	}
	if err := publish(); err != nil {
		t.Fatal(err)
	}
	admin := newClient(t, cluster.ListenAddrs())
	del := kmsg.NewPtrDeleteTopicsRequest()
	dt := kmsg.NewDeleteTopicsRequestTopic()
	dt.Topic = kmsg.StringPtr(kafkaTopic)
	del.Topics, del.TopicNames = append(del.Topics, dt), []string{kafkaTopic}
	if _, err := del.RequestWith(ctx, admin); err != nil {
		t.Fatal(err)
	}
	create := kmsg.NewPtrCreateTopicsRequest()
	ct := kmsg.NewCreateTopicsRequestTopic()
	ct.Topic, ct.NumPartitions, ct.ReplicationFactor = kafkaTopic, 1, 1
	create.Topics = append(create.Topics, ct)
	if resp, err := create.RequestWith(ctx, admin); err != nil || resp.Topics[0].ErrorCode != 0 {
		t.Fatalf("create the topic again: %v %+v", err, resp)
	}
	var errs []error
	for range 5 {
		err := publish()
		if err == nil {
			return
		}
		if outbox.IsPermanent(err) {
			t.Fatalf("a publish to the topic created again: %v, want an error to retry", err)
		}
		errs = append(errs, err)
	}
	t.Fatalf("no publish to the topic created again went through in 5 attempts: %v", errs)
}

// TestBatchTooLargeIsRetried: the broker's "too large" answers a whole
// batch; records that fit on their own, refused with a batch of others
// published at the same moment, are retried, not dead-lettered.
func TestBatchTooLargeIsRetried(t *testing.T) {
	cluster := startCluster(t, kfake.BrokerConfigs(map[string]string{"message.max.bytes": "4096"}))
	p := newPublisher(t, newClient(t, cluster.ListenAddrs()), outboxkafka.Config{})
	payload := json.RawMessage(`"` + strings.Repeat("x", 1500) + `"`)
	if err := p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: payload}); err != nil {
		t.Fatalf("a record that fits, alone: %v", err)
	}
	refused := 0
	for round := 0; round < 20 && refused == 0; round++ {
		errs := make([]error, 200)
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() {
				errs[i] = p.Publish(ctx, outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: payload})
			})
		}
		wg.Wait()
		for _, err := range errs {
			if err == nil {
				continue
			}
			refused++
			if outbox.IsPermanent(err) || !errors.Is(err, kerr.MessageTooLarge) {
				t.Fatalf("a record that fits, refused with its batch: %v, want MessageTooLarge to retry", err)
			}
		}
	}
	if refused == 0 {
		t.Fatal("no batch of concurrent publishes went over the broker's limit in 20 rounds: the test did not test")
	}
}

// TestInvalidRecordIsRetried: the broker's "invalid record" answers a
// whole batch, whose other records may be valid: it is retried, not
// dead-lettered, and the producer goes on producing.
func TestInvalidRecordIsRetried(t *testing.T) {
	cluster := startCluster(t)
	p := newPublisher(t, newClient(t, cluster.ListenAddrs()), outboxkafka.Config{})
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
	if err := p.Publish(ctx, d); err != nil {
		t.Fatalf("first publish: %v", err)
	}
	// The next produce request is refused, every partition of it.
	cluster.ControlKey(int16(kmsg.Produce), func(kreq kmsg.Request) (kmsg.Response, error, bool) {
		req := kreq.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition, sp.ErrorCode = rp.Partition, kerr.InvalidRecord.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	d.ID = uuid.New()
	err := p.Publish(ctx, d)
	if err == nil || outbox.IsPermanent(err) || !errors.Is(err, kerr.InvalidRecord) {
		t.Fatalf("a record refused with its batch as invalid: %v, want InvalidRecord to retry", err)
	}
	if err := p.Publish(ctx, d); err != nil {
		t.Fatalf("the retry: %v", err)
	}
}

// TestInvalidTopicIsPermanent: an event mapped to a topic name Kafka
// refuses (empty, "." or "..", a character other than ASCII letters,
// digits, '.', '_' and '-', over 249 characters; by Config.Topic or by
// DefaultTopic's joining of two long names) fails at once, permanently,
// with ErrInvalidTopic naming the topic, instead of being retried as a
// topic not created yet; names at the edges of the rules are produced.
func TestInvalidTopicIsPermanent(t *testing.T) {
	longest := strings.Repeat("t", 249)
	cluster := startCluster(t, kfake.SeedTopics(1, longest, "Mixed_Case-1.0"))
	cl := newClient(t, cluster.ListenAddrs())
	to := func(name string) *outboxkafka.Publisher {
		return newPublisher(t, cl, outboxkafka.Config{Topic: func(outbox.Delivery) string { return name }})
	}
	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}

	for _, name := range []string{longest, "Mixed_Case-1.0"} {
		if err := to(name).Publish(ctx, d); err != nil {
			t.Errorf("topic %q (%d characters): %v", name, len(name), err)
		}
	}

	check := func(p *outboxkafka.Publisher, d outbox.Delivery, topic string) {
		t.Helper()
		// The bound only ends the publish that the check should have
		// refused without producing.
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		err := p.Publish(pctx, d)
		if !outbox.IsPermanent(err) || !errors.Is(err, outboxkafka.ErrInvalidTopic) || !strings.Contains(err.Error(), strconv.Quote(topic)) {
			t.Errorf("topic %.40q (%d characters): got %v, want a permanent ErrInvalidTopic naming it", topic, len(topic), err)
		}
	}
	for _, name := range []string{"", ".", "..", "a/b", "a b", "événements", "events\n", strings.Repeat("t", 250)} {
		check(to(name), d, name)
	}
	long := outbox.Delivery{ID: uuid.New(), Namespace: strings.Repeat("n", 128), Topic: strings.Repeat("t", 128), Payload: json.RawMessage(`{}`)}
	check(newPublisher(t, cl, outboxkafka.Config{}), long, outboxkafka.DefaultTopic(long))
}

// TestDefaultProduceTopic: New refuses a client whose default produce
// topic Kafka refuses; with a valid one, an event mapped to no topic goes
// to it, and with DefaultProduceTopicAlways every event does, whatever
// Config.Topic says.
func TestDefaultProduceTopic(t *testing.T) {
	cluster := startCluster(t)
	addrs := cluster.ListenAddrs()
	_, err := outboxkafka.New(newClient(t, addrs, kgo.DefaultProduceTopic("a/b")), outboxkafka.Config{})
	if !errors.Is(err, outbox.ErrInvalidConfig) || !errors.Is(err, outboxkafka.ErrInvalidTopic) {
		t.Errorf("default produce topic a/b: got %v, want ErrInvalidConfig and ErrInvalidTopic", err)
	}

	d := outbox.Delivery{ID: uuid.New(), Namespace: "test", Topic: "events", Payload: json.RawMessage(`{}`)}
	empty := newPublisher(t, newClient(t, addrs, kgo.DefaultProduceTopic(kafkaTopic)),
		outboxkafka.Config{Topic: func(outbox.Delivery) string { return "" }})
	if err := empty.Publish(ctx, d); err != nil {
		t.Errorf("no topic, the client's default %q: %v", kafkaTopic, err)
	}
	d2 := d
	d2.ID = uuid.New()
	always := newPublisher(t, newClient(t, addrs, kgo.DefaultProduceTopic(kafkaTopic), kgo.DefaultProduceTopicAlways()),
		outboxkafka.Config{Topic: func(outbox.Delivery) string { return "a/b" }})
	if err := always.Publish(ctx, d2); err != nil {
		t.Errorf("topic a/b, the client's default %q always: %v", kafkaTopic, err)
	}
	got := map[uuid.UUID]int{}
	for _, r := range readAll(t, addrs, 2) {
		got[eventID(t, r)]++
	}
	if got[d.ID] != 1 || got[d2.ID] != 1 || len(got) != 2 {
		t.Errorf("%s holds %v, want %s and %s once each", kafkaTopic, got, d.ID, d2.ID)
	}
}
