package outboxui

import (
	"context"
	"fmt"
	"time"
)

// rightsTTL is how long the dashboard keeps what its database login may do
// (Admin.Rights) before it asks again: a GRANT or REVOKE shows within it.
// A failed read is kept too, as nothing known (the dashboard then offers
// what its options allow, and the database refuses what the login may not
// do), so that a database that is down costs one warning a rightsTTL
// rather than one a page.
const rightsTTL = time.Minute

// access is what a page may offer, from the options and the database
// login's rights.
type access struct {
	// CanOperate: an operator token is configured and the login may
	// replay and purge (or the database cannot tell).
	CanOperate bool
	// ReadOnly says why the dashboard is read-only and what would change
	// it ("" when CanOperate), completing "This dashboard is read-only: ".
	ReadOnly string
	// PayloadsDenied: payloads were asked for (Options.ShowPayloads) but
	// the login may not read them; Login names it.
	PayloadsDenied bool
	Login          string
}

// access reads the login's rights (kept for rightsTTL) for a page. A failed
// read is logged and leaves the options to decide.
func (h *handler) access(ctx context.Context) access {
	r, err := h.rights.get(ctx)
	if err != nil && ctx.Err() == nil {
		h.log.Warn("outboxui: reading what the database login may do failed; the pages offer what the options allow until it is read again",
			"error", err, "retry_in", rightsTTL)
	}
	a := access{Login: r.User, PayloadsDenied: h.opts.ShowPayloads && r.Known && !r.ReadPayloads}
	switch {
	case h.opts.OperatorToken == "":
		a.ReadOnly = "start it with an operator token to replay or purge"
	case r.Known && !r.Operate:
		a.ReadOnly = fmt.Sprintf("its database login %s may not replay or purge (grant it modkit_outbox_operator to enable them)", r.User)
	default:
		a.CanOperate = true
	}
	return a
}
