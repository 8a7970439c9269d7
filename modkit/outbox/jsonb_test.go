package outbox

import (
	"encoding/json"
	"strings"
	"testing"
)

// jsonSyntaxCases are documents at the edges of JSON's grammar, for
// checkPayload's agreement with encoding/json.Valid.
var jsonSyntaxCases = []string{
	``, ` `, `{}`, `[]`, `""`, `0`, `-0`, `1`, `-`, `01`, `-01`, `1.`, `.5`, `1.5`, `1e`, `1e+`, `1e5`, `1E-5`, `1.5e+05`,
	`true`, `false`, `null`, `tru`, `truex`, `nul`, `True`, `NaN`, `Infinity`, `+1`, `0x10`,
	` {"a" : [1 , 2] } `, "\t\n\r[1]\r\n", "\f[]", "\v1", "[1]\x00",
	`{"a":1,}`, `[1,]`, `[,1]`, `{,}`, `{"a"}`, `{"a":}`, `{"a" 1}`, `{1:2}`, `{"a":1 "b":2}`, `[1 2]`, `{"a":1}}`, `[[]`, `[]]`, `{}{}`,
	`"a\"b"`, `"\\"`, `"\/"`, `"\b\f\n\r\t"`, `"\a"`, `"\x41"`, `"\u00e9"`, `"\u00E9"`, `"\u00g9"`, `"\u12"`, `"\`, `"abc`,
	"\"tab\tinside\"", "\"\x7f\"", "\"\xff\"", "\xff", `"\ud800"`, `"\ud83d\ude00"`, `"\ud83d\u0041"`, `"\ud83d\u00zz"`, `"\ud83d\u"`,
	`{"\u0000":1}`, `[1e1073741823]`, `[{"a":[{"b":[]}]},null,"x",-1.5e-3]`,
}

func TestCheckPayloadSyntaxMatchesEncodingJSON(t *testing.T) {
	for _, doc := range jsonSyntaxCases {
		if got, want := checkPayloadValid(doc), json.Valid([]byte(doc)); got != want {
			t.Errorf("%q: checkPayload says valid=%v, encoding/json.Valid %v", doc, got, want)
		}
	}
}

// encoding/json refuses documents nested deeper than 10,000 objects or
// arrays; so must checkPayload, empty innermost containers included.
func TestCheckPayloadDepthMatchesEncodingJSON(t *testing.T) {
	for _, depth := range []int{jsonMaxDepth - 1, jsonMaxDepth, jsonMaxDepth + 1} {
		for _, doc := range []string{
			strings.Repeat("[", depth) + strings.Repeat("]", depth),
			strings.Repeat("[", depth) + "1" + strings.Repeat("]", depth),
			strings.Repeat(`{"a":`, depth-1) + "{}" + strings.Repeat("}", depth-1),
			strings.Repeat(`{"a":[`, depth/2) + strings.Repeat("]}", depth/2),
		} {
			if got, want := checkPayloadValid(doc), json.Valid([]byte(doc)); got != want {
				t.Errorf("depth %d, %.12q…: checkPayload says valid=%v, encoding/json.Valid %v", depth, doc, got, want)
			}
		}
	}
}

// A payload with several of jsonb's problems is refused for the first one
// in document order, object keys included, and a syntax error anywhere
// outranks them all.
func TestCheckPayloadFirstReason(t *testing.T) {
	for _, c := range []struct{ doc, want string }{
		{`{"a":"\u0000","b":1e1073741823}`, `\u0000`},
		{`{"\udc00":"\u0000"}`, `surrogate escape \udc00`},
		{`[1e200000,"\ud800"]`, `number 1e200000`},
		{`["\ud83d\ude00", "\ud83d"]`, `surrogate escape \ud83d`},
		{`{"a":"\u0000"`, ``},
		{`{"a":"\u0000"} x`, ``},
		{`"\u0000\u00zz"`, ``},
	} {
		valid, why, _ := checkPayload([]byte(c.doc))
		if c.want == "" {
			if valid {
				t.Errorf("%q: valid (%q), want a syntax error", c.doc, why)
			}
			continue
		}
		if !valid || !strings.Contains(why, c.want) {
			t.Errorf("%q: valid=%v, %q; want a reason naming %q", c.doc, valid, why, c.want)
		}
	}
}

// FuzzCheckPayload explores checkPayload's agreement with
// encoding/json.Valid beyond the cases above (go test -fuzz=FuzzCheckPayload
// ./modkit/outbox); whether jsonb stores what it accepts is checked against
// the server by TestPayloadValidationMatchesJSONB and
// FuzzMessageValidation.
func FuzzCheckPayload(f *testing.F) {
	for _, doc := range jsonSyntaxCases {
		f.Add([]byte(doc))
	}
	f.Fuzz(func(t *testing.T, doc []byte) {
		valid, why, _ := checkPayload(doc)
		if want := json.Valid(doc); valid != want {
			t.Fatalf("%q: checkPayload says valid=%v, encoding/json.Valid %v", doc, valid, want)
		}
		if !valid && why != "" {
			t.Fatalf("%q: invalid JSON with a jsonb reason %q", doc, why)
		}
	})
}

func checkPayloadValid(doc string) bool {
	valid, _, _ := checkPayload([]byte(doc))
	return valid
}
