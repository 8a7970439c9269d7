package outbox

import (
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

// jsonbIncompatibility reports why PostgreSQL's jsonb would refuse doc,
// which must already be valid JSON to encoding/json, or "" when it would
// store it. Go accepts things jsonb does not: invalid UTF-8 inside strings,
// the escape \u0000, unpaired UTF-16 surrogate escapes, and numbers beyond
// numeric's range. Catching them here keeps Enqueue's promise that bad
// input fails before any SQL runs and leaves the caller's transaction
// usable.
func jsonbIncompatibility(doc []byte) string {
	if !utf8.Valid(doc) {
		return "contains invalid UTF-8"
	}
	for i := 0; i < len(doc); {
		switch c := doc[i]; {
		case c == '"':
			end, why := scanJSONString(doc, i+1)
			if why != "" {
				return why
			}
			i = end
		case c == '-' || (c >= '0' && c <= '9'):
			end, why := scanJSONNumber(doc, i)
			if why != "" {
				return why
			}
			i = end
		default:
			i++
		}
	}
	return ""
}

// scanJSONString checks the string whose body starts at i and returns the
// index just past its closing quote.
func scanJSONString(doc []byte, i int) (int, string) {
	for i < len(doc) {
		switch doc[i] {
		case '"':
			return i + 1, ""
		case '\\':
			if doc[i+1] != 'u' {
				i += 2
				continue
			}
			r := hex4(doc[i+2 : i+6])
			i += 6
			switch {
			case r == 0:
				return i, `contains the escape \u0000, which PostgreSQL jsonb cannot store`
			case utf16.IsSurrogate(r):
				if r >= 0xdc00 || i+6 > len(doc) || doc[i] != '\\' || doc[i+1] != 'u' ||
					utf16.DecodeRune(r, hex4(doc[i+2:i+6])) == utf8.RuneError {
					return i, fmt.Sprintf(`contains the unpaired UTF-16 surrogate escape \u%04x, which PostgreSQL jsonb cannot store`, r)
				}
				i += 6
			}
		default:
			i++
		}
	}
	return i, ""
}

// scanJSONNumber checks the number starting at i against numeric's range
// and returns the index just past it.
func scanJSONNumber(doc []byte, i int) (int, string) {
	start := i
	if doc[i] == '-' {
		i++
	}
	// weight is the power of ten the first significant digit stands for.
	// JSON allows no leading zeros, so a nonzero integer part starts with
	// its first significant digit.
	intStart := i
	for i < len(doc) && isDigit(doc[i]) {
		i++
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
	}
	exp := 0
	if i < len(doc) && (doc[i] == 'e' || doc[i] == 'E') {
		i++
		neg := false
		if doc[i] == '+' || doc[i] == '-' {
			neg = doc[i] == '-'
			i++
		}
		for ; i < len(doc) && isDigit(doc[i]); i++ {
			if exp < numericMaxExp {
				exp = exp*10 + int(doc[i]-'0')
			}
		}
		if exp >= numericMaxExp {
			return i, fmt.Sprintf("has the number %s, whose exponent is beyond PostgreSQL numeric's range", abbreviate(doc[start:i]))
		}
		if neg {
			exp = -exp
		}
	}
	if max(0, fracDigits-exp) > numericMaxScale || (nonzero && weight+exp > numericMaxWeight) {
		return i, fmt.Sprintf("has the number %s, which is beyond PostgreSQL numeric's range (%d digits before the decimal point, %d after)",
			abbreviate(doc[start:i]), numericMaxWeight+1, numericMaxScale)
	}
	return i, ""
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func hex4(b []byte) rune {
	var r rune
	for _, c := range b {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			r |= rune(c - 'A' + 10)
		}
	}
	return r
}

func abbreviate(b []byte) string {
	if len(b) > 40 {
		return string(b[:20]) + "…" + string(b[len(b)-10:])
	}
	return string(b)
}
