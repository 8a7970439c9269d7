package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// report is everything one run found, printed as one table or as JSON.
type report struct {
	Started  time.Time         `json:"started"`
	Elapsed  string            `json:"elapsed"`
	Command  string            `json:"command"`
	Machine  map[string]string `json:"machine"`
	Postgres postgresReport    `json:"postgres"`
	Params   map[string]string `json:"parameters"`
	// Rounds is how many times each comparison was measured, library and
	// baseline alternating (see rounds.go).
	Rounds  int      `json:"rounds"`
	Results []row    `json:"results"`
	Errors  []string `json:"errors,omitempty"`
}

type postgresReport struct {
	Version  string            `json:"version"`
	Server   string            `json:"server"`
	Settings map[string]string `json:"settings"`
}

// row is one line of the table. The string fields are what the table
// shows; Values holds the same figures as numbers for JSON consumers.
type row struct {
	Workload string             `json:"workload"`
	Measure  string             `json:"measure"`
	Outbox   string             `json:"outbox"`
	Baseline string             `json:"baseline,omitempty"`
	Ratio    string             `json:"ratio,omitempty"`
	Target   string             `json:"target,omitempty"`
	Met      *bool              `json:"met,omitempty"`
	Note     string             `json:"note,omitempty"`
	Values   map[string]float64 `json:"values,omitempty"`
	// Runs holds, for figures measured in rounds, each round's value in
	// run order (see rounds.go).
	Runs map[string][]float64 `json:"runs,omitempty"`
}

func ptr[T any](v T) *T { return &v }

// print writes the report as one table: the context first, then a line per
// figure, then the notes.
func (r *report) print(w io.Writer) {
	fmt.Fprintf(w, "modkit outbox benchmark, %s, took %s\n", r.Started.Format("2006-01-02 15:04 MST"), r.Elapsed)
	fmt.Fprintf(w, "command   %s\n", r.Command)
	m := r.Machine
	fmt.Fprintf(w, "machine   %s CPUs (%s), GOMAXPROCS %s, %s %s, memory %s, load average %s at start, %s at end\n",
		m["cpus"], cmp.Or(m["cpu_model"], "unknown model"), m["gomaxprocs"], m["go"], m["os_arch"], cmp.Or(m["memory"], "?"),
		m["load_start"], m["load_end"])
	fmt.Fprintf(w, "postgres  %s, %s\n", r.Postgres.Version, r.Postgres.Server)
	fmt.Fprintf(w, "settings  %s\n", joinMap(r.Postgres.Settings, serverSettings))
	fmt.Fprintf(w, "sizes     %s\n", joinMap(r.Params, slices.Sorted(maps.Keys(r.Params))))
	if r.Rounds > 1 {
		fmt.Fprintf(w, "rounds    %d per comparison, run alternately (library, baseline, library, baseline, …); each figure is the median "+
			"of its rounds (min–max); RATIO is the ratio of the medians (min–max of the per-round ratios)\n", r.Rounds)
	}
	fmt.Fprintln(w)

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKLOAD\tMEASURE\tOUTBOX\tRAW SQL BASELINE\tRATIO\tTARGET\tMET")
	var notes []string
	for _, x := range r.Results {
		workload := x.Workload
		if x.Note != "" {
			notes = append(notes, x.Note)
			workload += fmt.Sprintf(" [%d]", len(notes))
		}
		met := ""
		if x.Met != nil {
			met = map[bool]string{true: "met", false: "NOT MET"}[*x.Met]
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", workload, x.Measure, x.Outbox,
			cmp.Or(x.Baseline, "-"), cmp.Or(x.Ratio, "-"), cmp.Or(x.Target, "-"), cmp.Or(met, "-"))
	}
	_ = tw.Flush()
	if len(notes) > 0 {
		fmt.Fprintln(w)
		for i, n := range notes {
			fmt.Fprintf(w, "[%d] %s\n", i+1, n)
		}
	}
	for _, e := range r.Errors {
		fmt.Fprintf(w, "ERROR %s\n", e)
	}
}

// printJSON writes the report as indented JSON.
func (r *report) printJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

func joinMap(m map[string]string, order []string) string {
	var parts []string
	for _, k := range order {
		if v, ok := m[k]; ok {
			parts = append(parts, k+"="+v)
		}
	}
	return strings.Join(parts, " ")
}

// fmtRate renders a per-second rate with thousands separators.
func fmtRate(perSecond float64) string {
	if perSecond < 100 {
		return strconv.FormatFloat(perSecond, 'f', 2, 64) + "/s"
	}
	return itoa(int64(perSecond+0.5)) + "/s"
}

// fmtMs renders a duration in milliseconds: "2.05 ms".
func fmtMs(d time.Duration) string { return fmtMsValue(float64(d)/float64(time.Millisecond)) + " ms" }

// fmtMsValue renders a number of milliseconds with three significant
// digits (at most two decimals), without the unit.
func fmtMsValue(ms float64) string {
	switch {
	case ms < 10:
		return strconv.FormatFloat(ms, 'f', 2, 64)
	case ms < 100:
		return strconv.FormatFloat(ms, 'f', 1, 64)
	}
	return strconv.FormatFloat(ms, 'f', 0, 64)
}

// itoa formats n with thousands separators: 1234567 -> "1,234,567".
func itoa(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	if neg {
		b.WriteByte('-')
	}
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}
