package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxamqp"
	"github.com/modkit-go/modkit/modkit/outbox/outboxhttp"
	"github.com/modkit-go/modkit/modkit/outbox/outboxkafka"
	"github.com/modkit-go/modkit/modkit/outbox/outboxnats"
)

// brokerSide is one broker of the brokers workload: start brings it up (in
// process where one exists) and returns its publisher and a clean-up.
type brokerSide struct {
	name  string
	start func(ctx context.Context) (outbox.Publisher, func(), error)
}

// runBrokers is the brokers workload (issue 17): events/s from committed
// events to broker acknowledgements, per broker, next to the same drain
// with a no-op publisher in the same rounds. RabbitMQ is the one on
// AMQP_URL or 127.0.0.1:5672, left out when none answers.
func (b *bench) runBrokers(ctx context.Context) error {
	if err := b.t.freshTable(ctx); err != nil {
		return err
	}
	n := min(b.opts.events, 20000)
	for _, br := range []brokerSide{
		{"NATS JetStream (in-process nats-server)", startNATS},
		{"Kafka (in-process kfake, linger 0)", startKafka},
		{"RabbitMQ (publisher confirms)", startRabbit},
		{"HTTP webhook (httptest receiver, signed)", startWebhook},
	} {
		pub, stop, err := br.start(ctx)
		if errors.Is(err, errBrokerAbsent) {
			b.log.Warn("brokers: left out", "broker", br.name, "why", err)
			continue
		}
		if err != nil {
			return fmt.Errorf("%s: %w", br.name, err)
		}
		runs, err := alternate(ctx, b, "brokers", b.opts.rounds, []side[drainResult]{
			{br.name, func(ctx context.Context, _ int) (drainResult, error) {
				if err := b.prepareDrain(ctx, "brokers", 0, n); err != nil {
					return drainResult{}, err
				}
				// The session settings of the no-op side (-dispatcher-settings), so
				// that the two sides differ by their publisher only.
				return b.drainDispatcherWith(ctx, n, b.opts.batch, b.opts.concurrency, b.opts.dispatcherSettings, &pub)
			}},
			{"no-op publisher", func(ctx context.Context, _ int) (drainResult, error) {
				return b.drainLibrary(ctx, "brokers-noop", 0, n, b.opts.batch)
			}},
		})
		stop()
		if err != nil {
			return err
		}
		got, noop := mapSeries(runs[0], drainRate), mapSeries(runs[1], drainRate)
		r := roundsRow("brokers", fmt.Sprintf("%s, %s events, batch %d", br.name, itoa(int64(n)), b.opts.batch), got, noop, 0)
		r.Note = "Events/s from committed events to broker acknowledgements. Baseline: the same drain with a publisher that does nothing." +
			roundsNote(got, noop)
		b.add(r)
	}
	return nil
}

// errBrokerAbsent: a broker the workload does not start itself is not there.
var errBrokerAbsent = errors.New("not reachable")

func startNATS(ctx context.Context) (outbox.Publisher, func(), error) {
	dir, err := os.MkdirTemp("", "outbox-bench-nats-")
	if err != nil {
		return outbox.Publisher{}, nil, err
	}
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoSigs: true, NoLog: true})
	if err != nil {
		return outbox.Publisher{}, nil, err
	}
	srv.Start()
	stop := func() { srv.Shutdown(); srv.WaitForShutdown(); _ = os.RemoveAll(dir) }
	if !srv.ReadyForConnections(10 * time.Second) {
		stop()
		return outbox.Publisher{}, nil, errors.New("nats-server did not start")
	}
	nc, err := nats.Connect(srv.ClientURL(), nats.MaxReconnects(-1))
	if err != nil {
		stop()
		return outbox.Publisher{}, nil, err
	}
	stopAll := func() { nc.Close(); stop() }
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(10*time.Second))
	if err == nil {
		_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH", Subjects: []string{benchTopic.Namespace + ".>"},
			Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute})
	}
	var p *outboxnats.Publisher
	if err == nil {
		p, err = outboxnats.New(js, outboxnats.Config{})
	}
	if err != nil {
		stopAll()
		return outbox.Publisher{}, nil, err
	}
	return p.For(benchTopic), stopAll, nil
}

func startKafka(context.Context) (outbox.Publisher, func(), error) {
	topic := outboxkafka.DefaultTopic(outbox.Delivery{Namespace: benchTopic.Namespace, Topic: benchTopic.Topic})
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic))
	if err != nil {
		return outbox.Publisher{}, nil, err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.ProducerLinger(0))
	if err != nil {
		cluster.Close()
		return outbox.Publisher{}, nil, err
	}
	stop := func() { cl.Close(); cluster.Close() }
	p, err := outboxkafka.New(cl, outboxkafka.Config{})
	if err != nil {
		stop()
		return outbox.Publisher{}, nil, err
	}
	return p.For(benchTopic), stop, nil
}

func startRabbit(context.Context) (outbox.Publisher, func(), error) {
	brokerURL := cmpOr(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	conn, err := amqp.DialConfig(brokerURL, amqp.Config{Dial: amqp.DefaultDial(2 * time.Second)})
	if err != nil {
		return outbox.Publisher{}, nil, fmt.Errorf("%w at %s (set AMQP_URL): %v", errBrokerAbsent, redactURL(brokerURL), err)
	}
	ch, err := conn.Channel()
	queue := benchTopic.Namespace + "." + benchTopic.Topic
	if err == nil {
		_, err = ch.QueueDeclare(queue, true, false, false, false, nil)
	}
	if err != nil {
		_ = conn.Close()
		return outbox.Publisher{}, nil, err
	}
	p, err := outboxamqp.New(outboxamqp.Config{URL: brokerURL})
	if err != nil {
		_ = conn.Close()
		return outbox.Publisher{}, nil, err
	}
	stop := func() {
		_ = p.Close()
		_, _ = ch.QueueDelete(queue, false, false, false)
		_ = conn.Close()
	}
	return p.For(benchTopic), stop, nil
}

func startWebhook(context.Context) (outbox.Publisher, func(), error) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	p, err := outboxhttp.New(outboxhttp.Config{Endpoint: srv.URL, Secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"})
	if err != nil {
		srv.Close()
		return outbox.Publisher{}, nil, err
	}
	return p.For(benchTopic), srv.Close, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// redactURL hides a URL's password.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}
