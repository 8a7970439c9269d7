package outbox

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/modkit-go/modkit/modkit/outbox/internal/dedupekey"
)

// BenchmarkValidate measures the client-side cost of checking one typical
// message (tenant, dedupe key, 128-byte payload), which every Enqueue and
// every message of an EnqueueBatch pays before any SQL runs.
func BenchmarkValidate(b *testing.B) {
	tenant := uuid.MustParse("0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65")
	m := Message{Namespace: "mini-chat", Topic: "usage_snapshot", TenantID: &tenant,
		DedupeKey: Key(hex32(tenant) + "/turn/0190b6c5-3f1e-7c9d-8a4b-2e1f0d9c8b7a/req-1"),
		Payload:   json.RawMessage(`{"turn":"0190b6c5-3f1e-7c9d-8a4b-2e1f0d9c8b7a","tokens":{"in":1234,"out":567},"credits":12.5,"note":"` + strings.Repeat("x", 20) + `"}`)}
	b.ReportAllocs()
	for b.Loop() {
		if err := validate(0, &m, payloadLimitDefault); err != nil {
			b.Fatal(err)
		}
	}
}

// TestNamesAndTenantKeys pins the name pattern and the tenant prefix rule
// that validate implements without regular expressions or allocations.
func TestNamesAndTenantKeys(t *testing.T) {
	for name, want := range map[string]bool{
		"a": true, "mini-chat": true, "usage.snapshot_v2": true, "0x": true, strings.Repeat("a", 128): true,
		"": false, "-a": false, ".a": false, "_a": false, "A": false, "a b": false, "a:b": false, "é": false,
		strings.Repeat("a", 129): false, "a/b": false,
	} {
		if got := validName(name); got != want {
			t.Errorf("validName(%q) = %v, want %v", name, got, want)
		}
	}
	tenant := uuid.MustParse("0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65")
	hex, hyph := hex32(tenant), tenant.String()
	for key, want := range map[string]bool{
		hex + "/x": true, strings.ToUpper(hex) + "/x": true, hyph + "/x": true, strings.ToUpper(hyph) + "/x": true,
		hex + "/": true, hex: false, hex + "x": false, hyph: false, "/" + hex + "/x": false,
		"0b7c6f1e5a4d4c3b9a2f1e0d9c8b7a66/x": false, "0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a66/x": false,
		"{0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65}/x": false, "urn:uuid:0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65/x": false,
		"0b7c6f1e5a4d4c3b9a2f1e0d9c8b7a6g/x": false,
	} {
		if id, _, ok := dedupekey.TenantPrefix(key); (ok && id == tenant) != want {
			t.Errorf("TenantPrefix(%q) = %v, %v; want tenant %v: %v", key, id, ok, tenant, want)
		}
	}
}

// storedKey spells a tenant's prefix canonically, and hands back the
// caller's own key when it already is.
func TestStoredKey(t *testing.T) {
	for range 100 {
		id := uuid.New()
		var text [36]byte
		if uuidText(&text, id); string(text[:]) != id.String() {
			t.Fatalf("uuidText gives %s for %s", text[:], id)
		}
	}
	tenant := uuid.MustParse("0b7c6f1e-5a4d-4c3b-9a2f-1e0d9c8b7a65")
	want := tenant.String() + "/turn/1"
	for _, key := range []string{want, hex32(tenant) + "/turn/1", strings.ToUpper(tenant.String()) + "/turn/1"} {
		m := Message{TenantID: &tenant, DedupeKey: Key(key)}
		got := storedKey(&m)
		if *got != want {
			t.Errorf("storedKey(%q) = %q, want %q", key, *got, want)
		}
		if same := got == m.DedupeKey; same != (key == want) {
			t.Errorf("storedKey(%q) returned the caller's key: %v, want %v", key, same, key == want)
		}
	}
	if m := (Message{DedupeKey: Key("k/1")}); storedKey(&m) != m.DedupeKey {
		t.Error("storedKey changed a key without a tenant")
	}
}
