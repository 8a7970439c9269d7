package outboxpg

import (
	"maps"
	"testing"
)

// Header values that are not strings (written with one's own SQL) read as
// their JSON text, null as "null" whatever else the object holds (it read
// as "" when every other value was a string), and empty strings stay empty.
func TestScanHeaders(t *testing.T) {
	for doc, want := range map[string]map[string]string{
		`{"a": "b"}`:               {"a": "b"},
		`{"e": ""}`:                {"e": ""},
		`{"n": null}`:              {"n": "null"},
		`{"n": null, "r": 3}`:      {"n": "null", "r": "3"},
		`{"e": "", "o": {"x": 1}}`: {"e": "", "o": `{"x": 1}`},
	} {
		got, err := scanHeaders([]byte(doc))
		if err != nil || !maps.Equal(got, want) {
			t.Errorf("%s: %v, %v; want %v", doc, got, err, want)
		}
	}
	if got, err := scanHeaders(nil); got != nil || err != nil {
		t.Errorf("no headers: %v, %v", got, err)
	}
}
