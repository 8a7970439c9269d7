package outboxui

import (
	"cmp"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// topicRow is one line of the overview's table.
type topicRow struct {
	outbox.TopicStats
	Name string // namespace/topic
	// DeliveredLastHour and PerMinute come from the series.
	DeliveredLastHour int64
	PerMinute         float64
	// Query is the events filter of this topic, URL-encoded; a
	// template.URL, so that the template does not escape its = and & again.
	Query template.URL
	// Unserved: the topic has events pending or processing and no running
	// dispatcher serves it (Admin.Unserved).
	Unserved bool
}

type overviewData struct {
	Topics           []topicRow
	Total            topicRow
	Chart            template.HTML
	Series           outbox.Series
	LastP50, LastP95 time.Duration
	Dispatchers      []dispatcherRow
	// SeriesTTL is how long the series is kept: the chart and the hourly
	// figures are that much behind at most.
	SeriesTTL time.Duration
	// SeriesErr is the error id of the log record that says why the
	// series could not be read; the chart and the hourly figures are then
	// left out.
	SeriesErr string
	// Blocked lists ordering keys whose dead head holds events back (some
	// wait behind it), longest dead first, at most blockedShown;
	// MoreBlocked says there are more, or may be (more dead heads than
	// blockedRead).
	Blocked     []outbox.BlockedKey
	MoreBlocked bool
	// Idle counts the keys whose dead head has nothing behind it (often a
	// key's only event), among the blockedRead longest dead: it holds back
	// only the key's events still to come. Listed with the others, they
	// crowded out the keys that hold events back. IdleAtLeast: more dead
	// heads than blockedRead, so there may be more.
	Idle        int
	IdleAtLeast bool
}

// blockedShown is how many blocked ordering keys the overview lists, and
// blockedRead how many dead heads it reads (Admin.BlockedKeys, longest dead
// first) to find them among those with nothing behind them.
const (
	blockedShown = 20
	blockedRead  = 200
)

// dispatcherRow is one dispatcher's health on the overview.
type dispatcherRow struct {
	WorkerID string
	State    string // Health.State: running, starting, degraded or stopped
	outbox.Health
}

// overview counts the backlog (Admin.Backlog: it reads no delivered
// event, so a page load costs the same whatever history the table keeps)
// and the last hour's deliveries (Admin.Series, read at most every
// seriesTTL: see load.go). A topic is listed when it
// has a pending, processing or dead event or a delivery in the last hour.
func (h *handler) overview(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	st, err := h.admin.Backlog(ctx)
	if err != nil {
		h.failInternal(w, r, "reading the statistics", err)
		return
	}
	// Without the series (a database role that may not read the delivery
	// history) the overview still shows the counts.
	d := overviewData{SeriesTTL: seriesTTL}
	series, err := h.series.get(ctx)
	if err != nil {
		d.SeriesErr = h.logInternal(r, slog.LevelWarn, "reading the delivery history for the overview's chart", err)
		series = outbox.Series{}
	}
	// Topics nobody serves are marked: their events wait without an error
	// anywhere else. A schema before migration 0034 cannot tell; a failed
	// read leaves the marks out, as a failed series leaves the chart out.
	unserved := map[outbox.Topic]bool{}
	if list, err := h.admin.Unserved(ctx); err == nil {
		for _, t := range list {
			unserved[t.Topic] = true
		}
	} else if !errors.Is(err, outbox.ErrNotMigrated) {
		h.logInternal(r, slog.LevelWarn, "reading which topics a dispatcher serves", err)
	}
	// Keys held back by a dead event: their later events wait without an
	// error of their own. A failed read leaves the section out.
	if blocked, err := h.admin.BlockedKeys(ctx, blockedRead+1); err == nil {
		truncated := len(blocked) > blockedRead
		for _, b := range blocked[:min(len(blocked), blockedRead)] {
			if b.Waiting == 0 {
				d.Idle++
			} else {
				d.Blocked = append(d.Blocked, b)
			}
		}
		d.MoreBlocked = len(d.Blocked) > blockedShown || truncated
		d.Blocked = d.Blocked[:min(len(d.Blocked), blockedShown)]
		d.IdleAtLeast = truncated
	} else if !errors.Is(err, outbox.ErrNotMigrated) {
		h.logInternal(r, slog.LevelWarn, "reading the blocked ordering keys", err)
	}
	hourly := map[outbox.Topic]int64{}
	for _, ts := range series.Topics {
		hourly[ts.Topic] = ts.Delivered
	}
	minutes := max(series.End.Sub(series.Start).Minutes(), 1)
	d.Series, d.Chart = series, chartSVG(series)
	topics := st.Topics
	for _, ts := range series.Topics {
		if !slices.ContainsFunc(topics, func(s outbox.TopicStats) bool { return s.Topic == ts.Topic }) {
			topics = append(topics, outbox.TopicStats{Topic: ts.Topic})
		}
	}
	slices.SortFunc(topics, func(a, b outbox.TopicStats) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Topic.Topic, b.Topic.Topic))
	})
	for _, t := range topics {
		q := url.Values{"namespace": {t.Namespace}, "topic": {t.Topic.Topic}}
		row := topicRow{TopicStats: t, Name: t.Namespace + "/" + t.Topic.Topic, DeliveredLastHour: hourly[t.Topic], Query: template.URL(q.Encode()),
			Unserved: unserved[t.Topic]}
		row.PerMinute = float64(row.DeliveredLastHour) / minutes
		d.Topics = append(d.Topics, row)
	}
	d.Total = topicRow{TopicStats: st.Total, Name: "all topics", DeliveredLastHour: series.Total.Delivered,
		PerMinute: float64(series.Total.Delivered) / minutes}
	for _, p := range series.Total.Points {
		if p.Delivered > 0 {
			d.LastP50, d.LastP95 = p.LatencyP50, p.LatencyP95
		}
	}
	for _, disp := range h.opts.Dispatchers {
		if disp == nil {
			continue // an fx app without publishers has no dispatcher
		}
		hl := disp.Health()
		d.Dispatchers = append(d.Dispatchers, dispatcherRow{WorkerID: disp.Config().WorkerID.String(), State: hl.State(), Health: hl})
	}
	h.render(w, http.StatusOK, "overview.html", h.newPage(w, r, "Outbox", d))
}

type eventsData struct {
	Filter   outbox.EventFilter
	Tenant   string
	Statuses []outbox.Status
	Since    string // "", or a duration: events created in the last Since
	Ranges   []string
	Events   []outbox.Event
	Next     template.URL // query string of the next page, "" on the last (see topicRow.Query)
}

func (h *handler) events(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := outbox.EventFilter{Status: outbox.Status(q.Get("status")), Namespace: strings.TrimSpace(q.Get("namespace")),
		Topic: strings.TrimSpace(q.Get("topic")), After: q.Get("after"), Limit: 50}
	// A topic as the dashboard writes it, namespace/topic, names both.
	if ns, topic, ok := strings.Cut(f.Topic, "/"); ok {
		if f.Namespace != "" && f.Namespace != ns {
			h.fail(w, r, http.StatusBadRequest, fmt.Sprintf("Topic %q is of namespace %q, but Namespace is %q: clear one of them.",
				f.Topic, ns, f.Namespace))
			return
		}
		f.Namespace, f.Topic = ns, topic
	}
	d := eventsData{Statuses: []outbox.Status{outbox.StatusPending, outbox.StatusProcessing, outbox.StatusDelivered, outbox.StatusDead},
		Tenant: strings.TrimSpace(q.Get("tenant"))}
	if d.Tenant != "" {
		id, err := uuid.Parse(d.Tenant)
		if err != nil {
			h.fail(w, r, http.StatusBadRequest, fmt.Sprintf("Tenant %q is not a UUID.", d.Tenant))
			return
		}
		f.TenantID = &id
	}
	if d.Since = q.Get("since"); d.Since != "" {
		ago, err := time.ParseDuration(d.Since)
		if err != nil || ago <= 0 {
			h.fail(w, r, http.StatusBadRequest, fmt.Sprintf("Since %q is not a positive duration such as 1h.", d.Since))
			return
		}
		f.CreatedAfter = time.Now().Add(-ago)
	}
	d.Ranges = []string{"15m", "1h", "24h", "168h"}
	if d.Since != "" && !slices.Contains(d.Ranges, d.Since) {
		// A range from the URL stays selected, or the next submission of
		// the form would drop it.
		d.Ranges = append(d.Ranges, d.Since)
	}
	d.Filter = f
	page, err := h.admin.List(r.Context(), f)
	if errors.Is(err, outbox.ErrInvalidConfig) || errors.Is(err, outbox.ErrInvalidCursor) {
		h.fail(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if err != nil {
		h.failInternal(w, r, "listing events", err)
		return
	}
	d.Events = page.Events
	if page.NextPage != "" {
		next := url.Values{}
		for k, v := range q {
			next[k] = v
		}
		next.Del("flash") // a message of this request, not of the next page
		next.Del("flash_sig")
		next.Set("after", page.NextPage)
		d.Next = template.URL(next.Encode()) //nolint:gosec // url.Values.Encode escapes every value
	}
	h.render(w, http.StatusOK, "events.html", h.newPage(w, r, "Events", d))
}

type eventData struct {
	ID uuid.UUID
	// Event is the event's row; the zero Event when Purged.
	Event outbox.Event
	// Purged: the row is gone but the history is kept (Admin.Purge, a
	// dispatcher's retention, Publisher.DeleteOnDelivery). PurgedAt is
	// the time of the history's purged entry; zero without one (a
	// dispatcher's retention purge records none).
	Purged       bool
	PurgedAt     time.Time
	ShowPayloads bool
	// PayloadDenied: payloads were asked for, but the database login may
	// not read them (the reader role), so the page says so rather than
	// that the dashboard was started without them.
	PayloadDenied bool
	Payload       string
	History       []outbox.Attempt
	HistoryErr    string // the error id of the log record that says why the history could not be read, if it could not
}

func (h *handler) event(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		h.fail(w, r, http.StatusNotFound, "That is not an event id.")
		return
	}
	d := eventData{ID: id, ShowPayloads: h.opts.ShowPayloads}
	d.Event, err = h.admin.Get(r.Context(), id)
	d.Purged = errors.Is(err, outbox.ErrNotFound)
	if err != nil && !d.Purged {
		h.failInternal(w, r, "reading the event", err)
		return
	}
	if d.ShowPayloads {
		// A payload is never null in the table: none read means the
		// login may not read it, even when its rights could not be told.
		d.PayloadDenied = h.access(r.Context()).PayloadsDenied || (!d.Purged && d.Event.Payload == nil)
		d.Payload = string(d.Event.Payload)
	}
	// The event is shown even when its history cannot be read (a role
	// without access to the ledger, an older schema).
	if d.History, err = h.admin.History(r.Context(), id); err != nil {
		d.HistoryErr = h.logInternal(r, slog.LevelWarn, "reading an event's history", err)
	}
	if d.Purged && len(d.History) == 0 {
		msg := "No event " + id.String() + ", and no history of one."
		if d.HistoryErr != "" {
			msg = fmt.Sprintf("No event %s; its history could not be read either (error_id=%s).", id, d.HistoryErr)
		}
		h.fail(w, r, http.StatusNotFound, msg)
		return
	}
	if d.Purged {
		for _, a := range d.History {
			if a.Outcome == "purged" {
				d.PurgedAt = a.FinishedAt
			}
		}
	}
	h.render(w, http.StatusOK, "event.html", h.newPage(w, r, "Event "+id.String(), d))
}

// chartSVG draws deliveries per bucket as bars and the median and p95
// delivery latency as lines, on two scales, as inline SVG.
func chartSVG(s outbox.Series) template.HTML {
	const (
		width, height = 760.0, 220.0
		left, right   = 48.0, 56.0
		top, bottom   = 12.0, 28.0
		plotW, plotH  = width - left - right, height - top - bottom
	)
	pts := s.Total.Points
	if len(pts) == 0 {
		return ""
	}
	var maxN int64 = 1
	var maxLat time.Duration = time.Millisecond
	for _, p := range pts {
		maxN = max(maxN, p.Delivered)
		maxLat = max(maxLat, p.LatencyP95)
	}
	slot := plotW / float64(len(pts))
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart" id="chart" viewBox="0 0 %.0f %.0f" role="img" aria-label="Deliveries per %s and delivery latency over the last hour" xmlns="http://www.w3.org/2000/svg">`,
		width, height, s.Bucket)
	fmt.Fprintf(&b, `<rect class="plot" x="%.1f" y="%.1f" width="%.1f" height="%.1f"/>`, left, top, plotW, plotH)
	for i, p := range pts {
		if p.Delivered == 0 {
			continue
		}
		h := plotH * float64(p.Delivered) / float64(maxN)
		fmt.Fprintf(&b, `<rect class="bar" x="%.1f" y="%.1f" width="%.1f" height="%.1f"><title>%s: %d delivered</title></rect>`,
			left+float64(i)*slot+0.5, top+plotH-h, max(slot-1, 0.5), h, p.Start.UTC().Format("15:04"), p.Delivered)
	}
	line := func(class string, v func(outbox.SeriesPoint) time.Duration) {
		var path []string
		for i, p := range pts {
			if p.Delivered == 0 {
				continue
			}
			y := top + plotH - plotH*float64(v(p))/float64(maxLat)
			path = append(path, fmt.Sprintf("%.1f,%.1f", left+(float64(i)+0.5)*slot, y))
		}
		if len(path) > 0 {
			fmt.Fprintf(&b, `<polyline class="%s" points="%s"/>`, class, strings.Join(path, " "))
		}
	}
	line("p95", func(p outbox.SeriesPoint) time.Duration { return p.LatencyP95 })
	line("p50", func(p outbox.SeriesPoint) time.Duration { return p.LatencyP50 })
	// Axes: deliveries on the left, latency on the right, time below.
	fmt.Fprintf(&b, `<text class="axis" x="%.1f" y="%.1f" text-anchor="end">%d</text>`, left-4, top+8, maxN)
	fmt.Fprintf(&b, `<text class="axis" x="%.1f" y="%.1f" text-anchor="end">0</text>`, left-4, top+plotH)
	fmt.Fprintf(&b, `<text class="axis lat" x="%.1f" y="%.1f">%s</text>`, left+plotW+4, top+8, fmtAge(maxLat))
	fmt.Fprintf(&b, `<text class="axis lat" x="%.1f" y="%.1f">0</text>`, left+plotW+4, top+plotH)
	for i := 0; i < len(pts); i += max(1, len(pts)/4) {
		fmt.Fprintf(&b, `<text class="axis" x="%.1f" y="%.1f" text-anchor="middle">%s</text>`,
			left+(float64(i)+0.5)*slot, height-8, pts[i].Start.UTC().Format("15:04"))
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String()) //nolint:gosec // built from numbers and times only
}
