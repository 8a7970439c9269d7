package outbox

import (
	"bytes"
	"cmp"
	"fmt"
	"unicode/utf16"
	"unicode/utf8"
)

// PostgreSQL's numeric type, which jsonb uses for numbers, holds at most
// 131072 digits before the decimal point and 16383 after it, and refuses
// exponents of 2^30-1 or more in magnitude whatever the digits.
const (
	numericMaxWeight = 131071 // the highest power of ten a digit may stand for
	numericMaxScale  = 16383
	numericMaxExp    = 1<<30 - 1
)

// jsonMaxDepth is the deepest nesting of objects and arrays that
// encoding/json accepts.
const jsonMaxDepth = 10000

// checkPayload reads doc once and reports whether it is one JSON value as
// encoding/json.Valid defines it (valid), and if so the first reason, in
// document order, why PostgreSQL's jsonb would still refuse it ("" when
// jsonb stores it), and how many bytes its numbers gain when PostgreSQL
// prints them (grows): jsonb keeps a number as numeric, which prints in
// full, so the 8 bytes of 1e131071 come back as 131,072 digits, and a
// small payload of them as gigabytes that no read can return. Go accepts
// things jsonb does not: the escape \u0000,
// unpaired UTF-16 surrogate escapes and numbers beyond numeric's range
// (and invalid UTF-8 inside strings, which validate checks apart). Catching
// them here keeps Enqueue's promise that bad input fails before any SQL runs
// and leaves the caller's transaction usable.
//
// It does in one pass what json.Valid and a second scan for jsonb's limits
// did in two, for every message enqueued: two fifths of EnqueueBatch's own
// CPU went to those two passes (BENCHMARKS.md, "Bulk: one pass over each
// payload").
func checkPayload(doc []byte) (valid bool, why string, grows int) {
	var stackSpace [32]byte
	open := stackSpace[:0] // the '{' or '[' of each container the value at i is in
	wantValue := true
	i := 0
	for {
		i = skipJSONSpace(doc, i)
		if wantValue {
			if i == len(doc) {
				return false, "", 0
			}
			var ok bool
			var w string
			switch c := doc[i]; c {
			case '{', '[':
				if len(open) == jsonMaxDepth {
					return false, "", 0
				}
				if i = skipJSONSpace(doc, i+1); i < len(doc) && doc[i] == c+2 { // '}' and ']' follow '{' and '[' by two
					i++
					wantValue = false
					continue
				}
				open = append(open, c)
				if c == '{' {
					if i, ok, w = scanJSONKey(doc, i); !ok {
						return false, "", 0
					}
				}
				why = cmp.Or(why, w)
				continue
			case '"':
				i, ok, w = scanJSONString(doc, i+1)
			case 't':
				i, ok = scanJSONLiteral(doc, i, "true")
			case 'f':
				i, ok = scanJSONLiteral(doc, i, "false")
			case 'n':
				i, ok = scanJSONLiteral(doc, i, "null")
			default:
				var g int
				i, ok, w, g = scanJSONNumber(doc, i)
				grows += g
			}
			if !ok {
				return false, "", 0
			}
			why = cmp.Or(why, w)
			wantValue = false
			continue
		}
		if len(open) == 0 {
			if i != len(doc) {
				return false, "", 0
			}
			return true, why, grows
		}
		if i == len(doc) {
			return false, "", 0
		}
		switch top := open[len(open)-1]; doc[i] {
		case ',':
			i++
			if top == '{' {
				var ok bool
				var w string
				if i, ok, w = scanJSONKey(doc, skipJSONSpace(doc, i)); !ok {
					return false, "", 0
				}
				why = cmp.Or(why, w)
			}
			wantValue = true
		case top + 2:
			open = open[:len(open)-1]
			i++
		default:
			return false, "", 0
		}
	}
}

// skipJSONSpace returns the index of the first byte at or after i that is
// not JSON whitespace.
func skipJSONSpace(doc []byte, i int) int {
	for i < len(doc) && (doc[i] == ' ' || doc[i] == '\n' || doc[i] == '\r' || doc[i] == '\t') {
		i++
	}
	return i
}

// scanJSONLiteral checks that lit (true, false or null) starts at i and
// returns the index just past it.
func scanJSONLiteral(doc []byte, i int, lit string) (int, bool) {
	if !bytes.HasPrefix(doc[i:], []byte(lit)) {
		return i, false
	}
	return i + len(lit), true
}

// scanJSONKey checks an object member's name starting at i, and the colon
// after it, and returns the index just past the colon.
func scanJSONKey(doc []byte, i int) (int, bool, string) {
	if i == len(doc) || doc[i] != '"' {
		return i, false, ""
	}
	i, ok, why := scanJSONString(doc, i+1)
	if !ok {
		return i, false, ""
	}
	if i = skipJSONSpace(doc, i); i == len(doc) || doc[i] != ':' {
		return i, false, ""
	}
	return i + 1, true, why
}

// scanJSONString checks the string whose body starts at i and returns the
// index just past its closing quote, and why jsonb would refuse the string.
func scanJSONString(doc []byte, i int) (int, bool, string) {
	why := ""
	for i < len(doc) {
		for i < len(doc) && plainStringByte[doc[i]] {
			i++
		}
		if i == len(doc) {
			break
		}
		switch doc[i] {
		case '"':
			return i + 1, true, why
		case '\\':
		default: // a control character
			return i, false, ""
		}
		if i+1 == len(doc) {
			return i, false, ""
		}
		switch doc[i+1] {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			i += 2
			continue
		case 'u':
		default:
			return i, false, ""
		}
		r, ok := hex4(doc, i+2)
		if !ok {
			return i, false, ""
		}
		i += 6
		if why != "" {
			continue
		}
		switch {
		case r == 0:
			why = `contains the escape \u0000, which PostgreSQL jsonb cannot store`
		case utf16.IsSurrogate(r):
			// A high surrogate must be followed by the escape of a low one;
			// the pair is one character.
			if low, ok := escapedRune(doc, i); r < 0xdc00 && ok && utf16.DecodeRune(r, low) != utf8.RuneError {
				i += 6
				continue
			}
			why = fmt.Sprintf(`contains the unpaired UTF-16 surrogate escape \u%04x, which PostgreSQL jsonb cannot store`, r)
		}
	}
	return i, false, ""
}

// plainStringByte tells the bytes that stand for themselves inside a JSON
// string: all but control characters, the quote and the backslash.
var plainStringByte = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// escapedRune reads a \uXXXX escape at i.
func escapedRune(doc []byte, i int) (rune, bool) {
	if i+1 >= len(doc) || doc[i] != '\\' || doc[i+1] != 'u' {
		return 0, false
	}
	return hex4(doc, i+2)
}

// scanJSONNumber checks the number starting at i, its syntax and its range
// against numeric's, and returns the index just past it and how many bytes
// longer than its text PostgreSQL prints it (numeric prints every digit:
// 1e6 as 1000000, 1e-6 as 0.000001).
func scanJSONNumber(doc []byte, i int) (int, bool, string, int) {
	start := i
	if i < len(doc) && doc[i] == '-' {
		i++
	}
	// weight is the power of ten the first significant digit stands for.
	// JSON allows no leading zeros, so a nonzero integer part starts with
	// its first significant digit.
	intStart := i
	switch {
	case i == len(doc) || !isDigit(doc[i]):
		return i, false, "", 0
	case doc[i] == '0':
		i++
	default:
		for i < len(doc) && isDigit(doc[i]) {
			i++
		}
	}
	fracDigits, weight, nonzero := 0, i-intStart-1, doc[intStart] != '0'
	if i < len(doc) && doc[i] == '.' {
		for i++; i < len(doc) && isDigit(doc[i]); i++ {
			fracDigits++
			if !nonzero && doc[i] != '0' {
				nonzero = true
				weight = -fracDigits
			}
		}
		if fracDigits == 0 {
			return i, false, "", 0
		}
	}
	exp := 0
	hasExp := i < len(doc) && (doc[i] == 'e' || doc[i] == 'E')
	if hasExp {
		i++
		neg := false
		if i < len(doc) && (doc[i] == '+' || doc[i] == '-') {
			neg = doc[i] == '-'
			i++
		}
		digits := i
		for ; i < len(doc) && isDigit(doc[i]); i++ {
			if exp < numericMaxExp {
				exp = exp*10 + int(doc[i]-'0')
			}
		}
		if i == digits {
			return i, false, "", 0
		}
		if exp >= numericMaxExp {
			return i, true, fmt.Sprintf("has the number %s, whose exponent is beyond PostgreSQL numeric's range", abbreviate(doc[start:i])), 0
		}
		if neg {
			exp = -exp
		}
	}
	if max(0, fracDigits-exp) > numericMaxScale || (nonzero && weight+exp > numericMaxWeight) {
		return i, true, fmt.Sprintf("has the number %s, which is beyond PostgreSQL numeric's range (%d digits before the decimal point, %d after)",
			abbreviate(doc[start:i]), numericMaxWeight+1, numericMaxScale), 0
	}
	if !hasExp {
		return i, true, "", 0 // printed as written
	}
	// Printed in full: the sign, the integer part (at least "0"), and the
	// decimal point and scale when there is a fraction.
	printed := 1 // the integer part of a number below 1, or of zero
	if nonzero {
		printed = max(1, weight+exp+1)
		if doc[start] == '-' {
			printed++
		}
	}
	if scale := max(0, fracDigits-exp); scale > 0 {
		printed += 1 + scale
	}
	return i, true, "", max(0, printed-(i-start))
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// hex4 reads the four hexadecimal digits at i.
func hex4(doc []byte, i int) (rune, bool) {
	if i+4 > len(doc) {
		return 0, false
	}
	var r rune
	for _, c := range doc[i : i+4] {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			r |= rune(c - 'A' + 10)
		default:
			return 0, false
		}
	}
	return r, true
}

func abbreviate(b []byte) string {
	if len(b) > 40 {
		return string(b[:20]) + "…" + string(b[len(b)-10:])
	}
	return string(b)
}
