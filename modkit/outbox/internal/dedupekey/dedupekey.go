// Package dedupekey holds the one rule for a dedupe key's tenant prefix,
// shared by the outbox, which stores the prefix in one spelling, and
// outboxtest, whose matchers compare keys as they are stored.
package dedupekey

import "github.com/google/uuid"

// TenantPrefix reports whether key begins with a tenant prefix: a UUID, in
// its 32-digit or hyphenated form and any letter case, followed by "/". It
// returns that tenant and the prefix's length without the "/".
func TenantPrefix(key string) (uuid.UUID, int, bool) {
	for _, n := range []int{32, 36} { // the two forms' lengths
		if len(key) > n && key[n] == '/' {
			if id, err := uuid.Parse(key[:n]); err == nil { // n excludes the {…} and urn: forms
				return id, n, true
			}
		}
	}
	return uuid.Nil, 0, false
}

// Stored is key as the outbox stores it: a tenant prefix in the one
// canonical spelling (lower-case, hyphenated), the rest as it is.
func Stored(key string) string {
	id, n, ok := TenantPrefix(key)
	if !ok {
		return key
	}
	return id.String() + key[n:]
}
