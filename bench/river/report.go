package main

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// series is one figure measured once per round, in round order.
type series []float64

func (s series) median() float64 {
	if len(s) == 0 {
		return 0
	}
	x := slices.Sorted(slices.Values(s))
	if n := len(x); n%2 == 1 {
		return x[n/2]
	} else {
		return (x[n/2-1] + x[n/2]) / 2
	}
}

// text renders the median and, for several rounds, the min–max.
func (s series) text(format func(float64) string) string { return s.textUnit(format, "") }

// textUnit is text with unit after the median: "10,527/s (9,345–17,174)".
func (s series) textUnit(format func(float64) string, unit string) string {
	if len(s) == 0 {
		return "-"
	}
	t := format(s.median()) + unit
	if len(s) > 1 {
		t += " (" + format(slices.Min(s)) + "–" + format(slices.Max(s)) + ")"
	}
	return t
}

// ratioText is median(s)/median(base) and the min–max of the per-round
// ratios.
func ratioText(s, base series) string {
	if len(s) == 0 || len(base) == 0 {
		return "-"
	}
	per := make(series, min(len(s), len(base)))
	for i := range per {
		per[i] = s[i] / base[i]
	}
	t := fmtRatio(s.median()/base.median()) + "×"
	if len(per) > 1 {
		t += " (" + fmtRatio(slices.Min(per)) + "–" + fmtRatio(slices.Max(per)) + ")"
	}
	return t
}

func fmtRatio(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }

func fmtCount(v float64) string {
	if v < 100 {
		return strconv.FormatFloat(v, 'f', 2, 64)
	}
	return itoa(int64(v + 0.5))
}

func fmtMs(v float64) string {
	switch {
	case v < 10:
		return strconv.FormatFloat(v, 'f', 2, 64)
	case v < 100:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func itoa(n int64) string {
	s := strconv.FormatInt(n, 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 && s[i-1] != '-' {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

// row is one line of the table.
type row struct {
	workload, measure      string
	outbox, river, raw     string
	vsRiver, vsRaw, target string
	note                   string
}

type report struct {
	started            time.Time
	elapsed            time.Duration
	command            string
	cpus               int
	loadStart, loadEnd string
	server, version    string
	settings           string
	rows               []row
	writes             *writesTable
	errors             []string
}

func (b *bench) add(r row) { b.report.rows = append(b.report.rows, r) }

// rateRow compares throughputs: the outbox's against River and raw SQL
// (either may be nil).
func rateRow(workload, measure string, lib, riv, raw series, target, note string) row {
	r := row{workload: workload, measure: measure, outbox: lib.textUnit(fmtCount, "/s"), river: "-", raw: "-",
		vsRiver: ratioText(lib, riv), vsRaw: ratioText(lib, raw), target: cmp.Or(target, "-"), note: note}
	if len(riv) > 0 {
		r.river = riv.textUnit(fmtCount, "/s")
	}
	if len(raw) > 0 {
		r.raw = raw.textUnit(fmtCount, "/s")
	}
	return r
}

func (r *report) print(w io.Writer) {
	fmt.Fprintf(w, "modkit outbox vs River benchmark, %s, took %s\n", r.started.UTC().Format("2006-01-02 15:04 MST"), r.elapsed)
	fmt.Fprintf(w, "command   %s\n", r.command)
	fmt.Fprintf(w, "machine   %d CPUs, load average %s at start, %s at end (a shared machine: other work runs beside this)\n", r.cpus, r.loadStart, r.loadEnd)
	fmt.Fprintf(w, "postgres  %s, %s\n", r.version, r.server)
	fmt.Fprintf(w, "settings  %s\n", r.settings)
	fmt.Fprintf(w, "rounds    every figure is the median of its rounds (min–max); sides alternate within each round; "+
		"a ratio is the ratio of the medians (min–max of the per-round ratios)\n\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKLOAD\tMEASURE\tOUTBOX\tRIVER\tRAW SQL\tOUTBOX/RIVER\tOUTBOX/RAW\tTARGET")
	var notes []string
	for _, x := range r.rows {
		name := x.workload
		if x.note != "" {
			notes = append(notes, x.note)
			name += fmt.Sprintf(" [%d]", len(notes))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", name, x.measure, x.outbox, x.river, x.raw, x.vsRiver, x.vsRaw, x.target)
	}
	_ = tw.Flush()
	if len(notes) > 0 {
		fmt.Fprintln(w)
		for i, n := range notes {
			fmt.Fprintf(w, "[%d] %s\n", i+1, n)
		}
	}
	if r.writes != nil {
		r.writes.print(w)
	}
	for _, e := range r.errors {
		fmt.Fprintf(w, "ERROR %s\n", e)
	}
}
