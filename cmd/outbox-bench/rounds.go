package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Every comparison the benchmark reports is measured in rounds. A round
// runs each side of the comparison once, back to back and always in the
// same order, the library first: L, B, L, B, L, B for -rounds=3. Whatever
// else loads the machine during the run (another process, autovacuum, a
// checkpoint) then weighs on both sides of a round alike, instead of on
// whichever phase it happened to coincide with, and one disturbed round
// moves a median of three or more rounds little. Each side is reported as
// its median over the rounds with its min–max, the ratio as the ratio of
// the two medians with the min–max of the per-round ratios (each round's
// library figure over the same round's baseline): a ratio whose rounds
// disagree widely was measured on a busy machine, not on a slower library.

// series is one figure, measured once per round, in round order.
type series []float64

// median is the middle value (the mean of the two middle ones for an even
// count); 0 for an empty series.
func (s series) median() float64 {
	if len(s) == 0 {
		return 0
	}
	x := slices.Sorted(slices.Values(s))
	n := len(x)
	if n%2 == 1 {
		return x[n/2]
	}
	return (x[n/2-1] + x[n/2]) / 2
}

// lo and hi are the lowest and highest value; the series must not be
// empty.
func (s series) lo() float64 { return slices.Min(s) }
func (s series) hi() float64 { return slices.Max(s) }

// ratios is s divided by base, round by round (both come from the same
// rounds, so they have the same length).
func (s series) ratios(base series) series {
	out := make(series, min(len(s), len(base)))
	for i := range out {
		out[i] = s[i] / base[i]
	}
	return out
}

// withSpread renders the median of s by format, followed, when there are
// several rounds, by their min–max: "20,874/s (19,950–21,402)".
func (s series) withSpread(format func(float64) string, unit string) string {
	text := format(s.median()) + unit
	if len(s) > 1 {
		text += " (" + format(s.lo()) + "–" + format(s.hi()) + ")"
	}
	return text
}

// side is one thing measured in every round: a library run or a baseline.
type side[T any] struct {
	name string
	run  func(ctx context.Context, round int) (T, error)
}

// alternate runs rounds rounds of sides: each round runs every side once,
// in the order given (library first, then its baseline, then any other
// variant), and the next round starts over. It returns each side's results
// in round order.
func alternate[T any](ctx context.Context, b *bench, workload string, rounds int, sides []side[T]) ([][]T, error) {
	out := make([][]T, len(sides))
	for round := range rounds {
		for i, s := range sides {
			b.log.Info(fmt.Sprintf("%s: round %d of %d: %s", workload, round+1, rounds, s.name))
			v, err := s.run(ctx, round)
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", s.name, round+1, err)
			}
			out[i] = append(out[i], v)
		}
	}
	return out, nil
}

// mapSeries turns per-round results into the series of one figure.
func mapSeries[T any](runs []T, figure func(T) float64) series {
	out := make(series, len(runs))
	for i, r := range runs {
		out[i] = figure(r)
	}
	return out
}

// fmtCount renders a rate without its unit, with thousands separators (or
// two decimals below 100).
func fmtCount(v float64) string { return strings.TrimSuffix(fmtRate(v), "/s") }

// fmtRatio renders a ratio with two decimals.
func fmtRatio(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }

// roundsRow is a row comparing the outbox's throughput (lib, one figure per
// round) with a baseline measured in the same rounds (base; nil for none):
// each side's median with its min–max, the ratio of the medians with the
// min–max of the per-round ratios. minRatio > 0 makes the ratio of the
// medians the target. The per-round figures go to the JSON output too.
func roundsRow(workload, measure string, lib, base series, minRatio float64) row {
	r := row{
		Workload: workload, Measure: measure, Outbox: lib.withSpread(fmtCount, "/s"),
		Values: map[string]float64{"outbox_per_s": lib.median(), "rounds": float64(len(lib))},
		Runs:   map[string][]float64{"outbox_per_s": lib},
	}
	if len(lib) > 1 {
		r.Values["outbox_min_per_s"], r.Values["outbox_max_per_s"] = lib.lo(), lib.hi()
	}
	if len(base) == 0 {
		return r
	}
	ratio, perRound := lib.median()/base.median(), lib.ratios(base)
	r.Baseline = base.withSpread(fmtCount, "/s")
	r.Ratio = fmtRatio(ratio) + "×"
	if len(perRound) > 1 {
		r.Ratio += " (" + fmtRatio(perRound.lo()) + "–" + fmtRatio(perRound.hi()) + ")"
		r.Values["baseline_min_per_s"], r.Values["baseline_max_per_s"] = base.lo(), base.hi()
		r.Values["ratio_min"], r.Values["ratio_max"] = perRound.lo(), perRound.hi()
	}
	r.Values["baseline_per_s"], r.Values["ratio"] = base.median(), ratio
	r.Runs["baseline_per_s"], r.Runs["ratio"] = base, perRound
	if minRatio > 0 {
		r.Target = "≥ " + strconv.FormatFloat(minRatio, 'f', -1, 64) + "×"
		r.Met = ptr(ratio >= minRatio)
	}
	return r
}

// roundsNote lists a comparison's rounds in run order, "0.93× (20,874 vs
// 22,456/s), …", for a row's note; empty for a single round.
func roundsNote(lib, base series) string {
	if len(lib) < 2 {
		return ""
	}
	parts := make([]string, len(lib))
	for i := range lib {
		if i < len(base) {
			parts[i] = fmt.Sprintf("%s× (%s vs %s/s)", fmtRatio(lib[i]/base[i]), fmtCount(lib[i]), fmtCount(base[i]))
		} else {
			parts[i] = fmtRate(lib[i])
		}
	}
	return " Rounds in run order: " + strings.Join(parts, ", ") + "."
}
