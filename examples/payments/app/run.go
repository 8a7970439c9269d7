// Package app is the payments example: participants submit payment
// instructions, which an API accepts and enqueues in the same transaction
// (ordered per participant, deduplicated per instruction), and dispatcher
// processes deliver to a payment rail over HTTP with the rail-safety rules
// of the payment documents. Run drives the whole scenario, with faults and
// a dispatcher killed mid-run, and reconciles the rail against the ledger.
package app

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/modkit-go/modkit/modkit/outbox"
	"github.com/modkit-go/modkit/modkit/outbox/outboxpg"
)

// Defaults of the demo.
const (
	InstructionsDefault = 300
	ParticipantsDefault = 12
	InvalidDefault      = 4
	DispatchersDefault  = 2
)

// DefaultFaults are the demo's injected rail faults.
var DefaultFaults = Faults{Latency: 15 * time.Millisecond, Unavailable: 0.08, LostResponse: 0.04}

// Options configure Run.
type Options struct {
	// DSN is an administrative connection (a superuser or the role that
	// owns the outbox): it migrates and creates the run's login roles.
	DSN string
	// Instructions over Participants; Invalid of them break a rail rule
	// (amount, currency or destination) and must end dead, unpaid.
	Instructions, Participants, Invalid int
	// Dispatchers is the number of dispatcher processes (at least 2: one
	// is killed with SIGKILL once a third of the instructions are paid).
	Dispatchers int
	Faults      Faults
	Seed        uint64
	// Spawn returns the command of a dispatcher process, which must call
	// RunDispatcherProcess; Run adds its environment and pipes.
	Spawn func() *exec.Cmd
	// DrainTimeout bounds the wait for every instruction to settle.
	DrainTimeout time.Duration
	Logger       *slog.Logger
	// Progress, if set, is told what the run is doing.
	Progress func(format string, args ...any)
}

func (o *Options) defaults() error {
	if o.Instructions == 0 {
		o.Instructions = InstructionsDefault
	}
	if o.Participants == 0 {
		o.Participants = ParticipantsDefault
	}
	if o.Invalid < 0 {
		o.Invalid = 0
	} else if o.Invalid == 0 {
		o.Invalid = InvalidDefault
	}
	if o.Dispatchers == 0 {
		o.Dispatchers = DispatchersDefault
	}
	if o.DrainTimeout == 0 {
		o.DrainTimeout = 45 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Progress == nil {
		o.Progress = func(string, ...any) {}
	}
	switch {
	case o.DSN == "" || o.Spawn == nil:
		return errors.New("payments: Options.DSN and Options.Spawn are required")
	case o.Dispatchers < 2:
		return errors.New("payments: at least 2 dispatchers (one is killed)")
	case o.Participants < 1 || o.Instructions < o.Participants || o.Invalid > o.Instructions/10:
		return errors.New("payments: need Instructions >= Participants >= 1 and Invalid <= Instructions/10")
	}
	return nil
}

// ErrNotDrained is returned when instructions are still unsettled at the
// end of Options.DrainTimeout.
var ErrNotDrained = errors.New("payments: instructions still unsettled")

// dispatcherProc is a running dispatcher process.
type dispatcherProc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *bytes.Buffer
	pid    string
	once   sync.Once // of kill
}

func (o *Options) startDispatcher(ctx context.Context, dsn, railURL string) (*dispatcherProc, error) {
	cmd := o.Spawn()
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, EnvDispatcherDSN+"="+dsn, EnvRailURL+"="+railURL)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &dispatcherProc{cmd: cmd, stderr: new(bytes.Buffer)}
	cmd.Stderr = p.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start a dispatcher process: %w", err)
	}
	p.pid = strconv.Itoa(cmd.Process.Pid)
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		ok := false
		for sc.Scan() {
			if sc.Text() == "ready" && !ok {
				ok = true
				ready <- true
			}
		}
		if !ok {
			ready <- false
		}
	}()
	select {
	case ok := <-ready:
		if !ok {
			_ = cmd.Wait()
			return nil, fmt.Errorf("dispatcher process %s exited before it was ready: %s", p.pid, p.stderr)
		}
	case <-ctx.Done():
		p.kill()
		return nil, ctx.Err()
	}
	return p, nil
}

// stop asks the process to stop (closes its stdin) and waits for it.
func (p *dispatcherProc) stop() error {
	_ = p.stdin.Close()
	if err := p.cmd.Wait(); err != nil {
		return fmt.Errorf("dispatcher process %s: %w: %s", p.pid, err, p.stderr)
	}
	return nil
}

// kill sends SIGKILL and reaps the process.
func (p *dispatcherProc) kill() {
	p.once.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		_ = p.cmd.Wait()
		_ = p.stdin.Close()
	})
}

// instructions generates the run's instructions, participant by
// participant, with o.Invalid of them breaking one rail rule each.
func (o *Options) instructions(participants []string) [][]Instruction {
	rnd := rand.New(rand.NewPCG(o.Seed, 0x696e7374))
	out := make([][]Instruction, len(participants))
	invalid := map[int]bool{}
	for len(invalid) < o.Invalid {
		invalid[rnd.IntN(o.Instructions)] = true
	}
	currencies := []string{"EUR", "GBP", "USD"}
	for i := range o.Instructions {
		p := i % len(participants)
		in := Instruction{
			ID: uuid.New(), Participant: participants[p],
			AmountMinor: 100 + rnd.Int64N(250_000),
			Currency:    currencies[rnd.IntN(len(currencies))],
			Destination: fmt.Sprintf("DE%02d%016d", rnd.IntN(100), rnd.Int64N(1e16)),
		}
		if invalid[i] {
			switch len(out[p]) % 3 {
			case 0:
				in.AmountMinor = MaxAmountMinor + 1
			case 1:
				in.Currency = "XAU"
			default:
				in.Destination = "not-an-account"
			}
		}
		out[p] = append(out[p], in)
	}
	return out
}

// Run runs the scenario and returns its reconciliation.
func Run(ctx context.Context, o Options) (*Summary, error) {
	if err := o.defaults(); err != nil {
		return nil, err
	}
	started := time.Now()
	admin, err := pgxpool.New(ctx, o.DSN)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	roles, err := Setup(ctx, admin, o.DSN)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := roles.Drop(context.WithoutCancel(ctx), admin); err != nil {
			o.Logger.Warn("dropping the run's roles", "error", err)
		}
	}()
	pools := map[string]*pgxpool.Pool{}
	for _, role := range []string{roles.API, roles.Operator, roles.Report} {
		dsn, err := roles.DSN(role)
		if err != nil {
			return nil, err
		}
		pool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		pools[role] = pool
	}
	client := func(role string) (*outbox.Client, error) {
		return outbox.New(outboxpg.New(pools[role]), outbox.Config{Logger: o.Logger})
	}
	apiClient, err := client(roles.API)
	if err != nil {
		return nil, err
	}
	opClient, err := client(roles.Operator)
	if err != nil {
		return nil, err
	}
	reportClient, err := client(roles.Report)
	if err != nil {
		return nil, err
	}

	// An interrupted run leaves events behind in a database that outlives
	// it (DATABASE_URL): this run's dispatchers deliver them too, and the
	// reconciliation checks them against their own run's ledger rows.
	leftover, err := unsettled(ctx, reportClient.Admin())
	if err != nil {
		return nil, err
	}
	if len(leftover) > 0 {
		o.Progress("%d instructions of earlier runs are undelivered or dead; this run delivers them too", len(leftover))
	}

	rail, err := StartRail(o.Faults, o.Seed)
	if err != nil {
		return nil, err
	}
	defer rail.Close()

	dispatcherDSN, err := roles.DSN(roles.Dispatcher)
	if err != nil {
		return nil, err
	}
	var procs []*dispatcherProc
	defer func() {
		for _, p := range procs {
			p.kill() // those still running after a failure
		}
	}()
	for range o.Dispatchers {
		p, err := o.startDispatcher(ctx, dispatcherDSN, rail.URL())
		if err != nil {
			return nil, err
		}
		procs = append(procs, p)
	}
	o.Progress("%d dispatcher processes ready (pids %s); rail on %s", len(procs), pids(procs), rail.URL())

	runID := uuid.New()
	participants := make([]string, o.Participants)
	for i := range participants {
		participants[i] = fmt.Sprintf("P%02d-%s", i+1, runID.String()[:8])
		if _, err := admin.Exec(ctx, "INSERT INTO payments_participants (id, run_id, name) VALUES ($1, $2, $3)",
			participants[i], runID, fmt.Sprintf("participant %d", i+1)); err != nil {
			return nil, fmt.Errorf("register participant: %w", err)
		}
	}

	runCtx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()

	// The kill: once a third is paid and the victim has a payment in
	// flight at the rail (or two thirds are paid, whichever comes first).
	victim := procs[0]
	killed := make(chan KillReport, 1)
	go func() {
		var inFlight int
		err := rail.WaitFor(runCtx, func(paid int, by map[string]int) bool {
			inFlight = by[victim.pid]
			return paid >= o.Instructions/3 && inFlight > 0 || paid >= 2*o.Instructions/3
		})
		if err != nil {
			killed <- KillReport{}
			return
		}
		victim.kill()
		// What was in flight when the condition held may have been
		// answered and recorded (its lease gone) before the kill landed.
		// A request of the victim the rail still counts now was never
		// answered (the rail counts it out before its answer is sent), so
		// the victim died holding its lease.
		_ = rail.WaitFor(ctx, func(_ int, by map[string]int) bool { inFlight = by[victim.pid]; return true })
		k := KillReport{PID: victim.pid, PaidBefore: len(rail.Payments()), InFlight: inFlight}
		o.Progress("SIGKILLed dispatcher %s after %d payments, with requests in flight at the rail: %d", k.PID, k.PaidBefore, k.InFlight)
		killed <- k
	}()

	// The operator: a dead instruction blocks its participant's later
	// ones; once it is listed as dead it is skipped so they go on.
	var (
		opMu    sync.Mutex
		skipped []uuid.UUID
		opErr   error // of the operator's last pass, for the drain's error
	)
	opDone := make(chan struct{})
	go func() {
		defer close(opDone)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-runCtx.Done():
				return
			case <-tick.C:
			}
			blocked, err := opClient.Admin().BlockedKeys(runCtx, 100)
			for _, b := range blocked {
				if b.Topic != Topic {
					continue
				}
				if err = opClient.Admin().SkipHead(runCtx, "payments operator", b.Head); err != nil {
					break
				}
				opMu.Lock()
				skipped = append(skipped, b.Head)
				opMu.Unlock()
				o.Progress("operator skipped dead head %s of %s: %s", b.Head, b.OrderingKey, b.LastError)
			}
			opMu.Lock()
			opErr = err
			opMu.Unlock()
		}
	}()

	// The API: each participant submits its instructions one after the
	// other, all participants at once.
	api := NewAPI(pools[roles.API], apiClient)
	var (
		accMu    sync.Mutex
		accepted []Accepted
		wg       sync.WaitGroup
		errs     = make(chan error, o.Participants)
	)
	for _, list := range o.instructions(participants) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, in := range list {
				a, err := api.Accept(runCtx, runID, in)
				if err != nil {
					errs <- err
					return
				}
				accMu.Lock()
				accepted = append(accepted, a)
				accMu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return nil, err
	}
	o.Progress("accepted %d instructions over %d participants", len(accepted), o.Participants)

	// Drain: every instruction delivered or dead, and every dead one
	// skipped by the operator (a participant's last instruction can die
	// after everything else has settled). The kill comes long before,
	// unless the rail pays too little for it (it fails every request, say):
	// then the reconciliation says that no dispatcher was killed.
	deadline := time.Now().Add(o.DrainTimeout)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := reportClient.Admin().Stats(ctx)
		if err != nil {
			return nil, err
		}
		var ts outbox.TopicStats
		for _, t := range st.Topics {
			if t.Topic == Topic {
				ts = t
			}
		}
		blocked, err := reportClient.Admin().BlockedKeys(ctx, 100)
		if err != nil {
			return nil, err
		}
		unskipped := 0
		for _, b := range blocked {
			if b.Topic == Topic {
				unskipped++
			}
		}
		if ts.Pending+ts.Processing == 0 && unskipped == 0 {
			break
		}
		if time.Now().After(deadline) {
			err := fmt.Errorf("%w after %s: %d pending, %d processing, %d dead heads not skipped", ErrNotDrained, o.DrainTimeout,
				ts.Pending, ts.Processing, unskipped)
			opMu.Lock()
			why := opErr
			opMu.Unlock()
			if why != nil {
				err = fmt.Errorf("%w; the operator failed: %w", err, why)
			}
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
	}
	cancelRun()
	kill := <-killed
	<-opDone
	running := procs[1:]
	if kill.PID == "" {
		running = procs // the victim too
	}
	for _, p := range running {
		if err := p.stop(); err != nil {
			return nil, err
		}
	}
	procs = nil
	o.Progress("all instructions settled; dispatchers stopped")

	opMu.Lock()
	defer opMu.Unlock()
	return reconcile(ctx, reconcileInput{
		runID: runID, pool: pools[roles.Report], admin: reportClient.Admin(), rail: rail,
		kill: kill, skipped: skipped, leftover: leftover, dispatchers: o.Dispatchers, invalid: o.Invalid,
		elapsed: time.Since(started), roles: roles,
	})
}

// unsettled returns the events of Topic that are pending, leased or dead:
// those an earlier run left, when a run starts.
func unsettled(ctx context.Context, admin *outbox.Admin) (map[uuid.UUID]bool, error) {
	events, err := topicEvents(ctx, admin, outbox.StatusPending, outbox.StatusProcessing, outbox.StatusDead)
	if err != nil {
		return nil, fmt.Errorf("list the events earlier runs left: %w", err)
	}
	out := make(map[uuid.UUID]bool, len(events))
	for id := range events {
		out[id] = true
	}
	return out, nil
}

// topicEvents lists every event of Topic in the given statuses, page by
// page, by id.
func topicEvents(ctx context.Context, admin *outbox.Admin, statuses ...outbox.Status) (map[uuid.UUID]outbox.Event, error) {
	out := map[uuid.UUID]outbox.Event{}
	for _, st := range statuses {
		f := outbox.EventFilter{Status: st, Namespace: Topic.Namespace, Topic: Topic.Topic, Limit: 1000}
		for {
			page, err := admin.List(ctx, f)
			if err != nil {
				return nil, err
			}
			for _, e := range page.Events {
				out[e.ID] = e
			}
			if page.NextPage == "" {
				break
			}
			f.After = page.NextPage
		}
	}
	return out, nil
}

func pids(ps []*dispatcherProc) string {
	var b bytes.Buffer
	for i, p := range ps {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(p.pid)
	}
	return b.String()
}
