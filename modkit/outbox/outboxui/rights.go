package outboxui

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/modkit-go/modkit/modkit/outbox"
)

// rightsTTL is how long the dashboard keeps what its database login may do
// (Admin.Rights) before it asks again: a GRANT or REVOKE shows within it.
const rightsTTL = time.Minute

// rightsCache keeps what the dashboard's database login may do for
// rightsTTL. A failed read is kept too, as nothing known (the dashboard
// then offers what its options allow, and the database refuses what the
// login may not do), so that a database that is down costs one warning a
// rightsTTL rather than one a page; a read cut short by its visitor
// leaving is not kept.
type rightsCache struct {
	read func(context.Context) (outbox.Rights, error)
	now  func() time.Time

	mu     sync.Mutex
	rights outbox.Rights
	at     time.Time // when rights was read; zero: nothing kept
}

// get returns what the login may do, read less than rightsTTL ago or now;
// err is the read's, when it failed now. The read runs without the lock,
// so that a slow one holds up no other request (requests that find the
// rights expired at the same moment each read them).
func (c *rightsCache) get(ctx context.Context) (outbox.Rights, error) {
	c.mu.Lock()
	if !c.at.IsZero() && c.now().Sub(c.at) < rightsTTL {
		defer c.mu.Unlock()
		return c.rights, nil
	}
	c.mu.Unlock()
	r, err := c.read(ctx)
	if err != nil {
		r = outbox.Rights{}
		if ctx.Err() != nil {
			return r, err
		}
	}
	c.mu.Lock()
	c.rights, c.at = r, c.now()
	c.mu.Unlock()
	return r, err
}

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

// access reads the login's rights (see rightsCache) for a page. A failed
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
