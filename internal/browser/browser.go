// Package browser drives a headless Chromium for tests over the DevTools
// protocol on a pipe (--remote-debugging-pipe: commands on fd 3, replies
// and events on fd 4, each message a JSON object ended by a NUL byte), so
// it needs no websocket library and opens no port.
//
// It does what the dashboard's browser tests need and no more: open a
// page, load a URL, evaluate JavaScript, click and wait for the next page,
// take a screenshot.
package browser

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"time"
)

// Candidates are the executables Find looks for, in order.
var Candidates = []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "/usr/bin/chromium"}

// Find returns the path of a Chromium executable, or an error saying none
// was found.
func Find() (string, error) {
	for _, c := range Candidates {
		if p, err := exec.LookPath(c); err == nil {
			return p, nil
		}
	}
	return "", errors.New("browser: no Chromium found (looked for chromium, chromium-browser, google-chrome); on Debian: apt-get install chromium")
}

// Browser is one running Chromium.
type Browser struct {
	cmd     *exec.Cmd
	dir     string
	out     *os.File // our end of the command pipe
	in      *os.File // our end of the reply pipe
	done    chan struct{}
	mu      sync.Mutex
	nextID  int64
	pending map[int64]chan message
	waiters []*waiter
	readErr error
}

type message struct {
	ID        int64           `json:"id,omitempty"`
	Method    string          `json:"method,omitempty"`
	Params    json.RawMessage `json:"params,omitempty"`
	SessionID string          `json:"sessionId,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	Error     *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error,omitempty"`
}

type waiter struct {
	session, method string
	ch              chan struct{}
}

// Launch starts Chromium at path, headless, with a fresh profile.
func Launch(path string) (*Browser, error) {
	dir, err := os.MkdirTemp("", "modkit-chromium-")
	if err != nil {
		return nil, err
	}
	cmdR, cmdW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	repR, repW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--disable-extensions", "--mute-audio", "--hide-scrollbars", "--window-size=1280,1000",
		"--user-data-dir="+dir, "--remote-debugging-pipe", "about:blank")
	cmd.ExtraFiles = []*os.File{cmdR, repW} // fd 3: commands in, fd 4: replies out
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("browser: start %s: %w", path, err)
	}
	_ = cmdR.Close()
	_ = repW.Close()
	b := &Browser{cmd: cmd, dir: dir, out: cmdW, in: repR, done: make(chan struct{}), pending: map[int64]chan message{}}
	go b.read()
	return b, nil
}

func (b *Browser) read() {
	defer close(b.done)
	r := bufio.NewReader(b.in)
	for {
		raw, err := r.ReadBytes(0)
		if err != nil {
			b.mu.Lock()
			b.readErr = fmt.Errorf("browser: connection closed: %w", err)
			for id, ch := range b.pending {
				close(ch)
				delete(b.pending, id)
			}
			b.mu.Unlock()
			return
		}
		var m message
		if json.Unmarshal(raw[:len(raw)-1], &m) != nil {
			continue
		}
		b.mu.Lock()
		if m.ID != 0 {
			if ch, ok := b.pending[m.ID]; ok {
				ch <- m
				delete(b.pending, m.ID)
			}
		} else {
			for _, w := range b.waiters {
				if w.method == m.Method && w.session == m.SessionID {
					select {
					case w.ch <- struct{}{}:
					default: // the subscriber has not taken the last ones yet
					}
				}
			}
		}
		b.mu.Unlock()
	}
}

// call sends one command and waits for its reply.
func (b *Browser) call(ctx context.Context, session, method string, params any, result any) error {
	b.mu.Lock()
	if b.readErr != nil {
		b.mu.Unlock()
		return b.readErr
	}
	b.nextID++
	id := b.nextID
	ch := make(chan message, 1)
	b.pending[id] = ch
	b.mu.Unlock()
	msg := map[string]any{"id": id, "method": method}
	if params != nil {
		msg["params"] = params
	}
	if session != "" {
		msg["sessionId"] = session
	}
	raw, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	if _, err := b.out.Write(append(raw, 0)); err != nil {
		return fmt.Errorf("browser: send %s: %w", method, err)
	}
	select {
	case <-ctx.Done():
		b.mu.Lock()
		delete(b.pending, id)
		b.mu.Unlock()
		return fmt.Errorf("browser: %s: %w", method, ctx.Err())
	case m, ok := <-ch:
		if !ok {
			return fmt.Errorf("browser: %s: the browser went away", method)
		}
		if m.Error != nil {
			return fmt.Errorf("browser: %s: %s (%d)", method, m.Error.Message, m.Error.Code)
		}
		if result != nil {
			return json.Unmarshal(m.Result, result)
		}
		return nil
	}
}

// subscribe delivers the occurrences of the event method of session on
// the returned channel until cancel is called; subscribe before the
// command that causes the event.
func (b *Browser) subscribe(session, method string) (ch chan struct{}, cancel func()) {
	w := &waiter{session: session, method: method, ch: make(chan struct{}, 16)}
	b.mu.Lock()
	b.waiters = append(b.waiters, w)
	b.mu.Unlock()
	return w.ch, func() {
		b.mu.Lock()
		defer b.mu.Unlock()
		for i, x := range b.waiters {
			if x == w {
				b.waiters = append(b.waiters[:i], b.waiters[i+1:]...)
				return
			}
		}
	}
}

// Close shuts the browser down and removes its profile.
func (b *Browser) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = b.call(ctx, "", "Browser.close", nil, nil)
	exited := make(chan error, 1)
	go func() { exited <- b.cmd.Wait() }()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-exited
	}
	_ = b.out.Close()
	<-b.done
	_ = b.in.Close()
	return os.RemoveAll(b.dir)
}

// Page is one tab.
type Page struct {
	b       *Browser
	session string
}

// NewPage opens a blank tab.
func (b *Browser) NewPage(ctx context.Context) (*Page, error) {
	var target struct {
		TargetID string `json:"targetId"`
	}
	if err := b.call(ctx, "", "Target.createTarget", map[string]any{"url": "about:blank"}, &target); err != nil {
		return nil, err
	}
	var att struct {
		SessionID string `json:"sessionId"`
	}
	if err := b.call(ctx, "", "Target.attachToTarget", map[string]any{"targetId": target.TargetID, "flatten": true}, &att); err != nil {
		return nil, err
	}
	p := &Page{b: b, session: att.SessionID}
	if err := b.call(ctx, p.session, "Page.enable", nil, nil); err != nil {
		return nil, err
	}
	if err := b.call(ctx, p.session, "Runtime.enable", nil, nil); err != nil {
		return nil, err
	}
	// Let the blank page finish loading, so that its load event cannot be
	// taken for the next page's.
	return p, p.Eval(ctx, `new Promise(r => document.readyState === "complete" ? r(true) : addEventListener("load", () => r(true)))`, nil)
}

func (p *Page) wait(ctx context.Context, ch chan struct{}, what string) error {
	select {
	case <-ch:
		return nil
	case <-p.b.done:
		return fmt.Errorf("browser: %s: the browser went away", what)
	case <-ctx.Done():
		return fmt.Errorf("browser: waiting for %s: %w", what, ctx.Err())
	}
}

// Navigate loads url and waits for its load event. url must be the
// address the page ends at (no redirect), written as the browser writes it.
func (p *Page) Navigate(ctx context.Context, url string) error {
	loaded, cancel := p.b.subscribe(p.session, "Page.loadEventFired")
	defer cancel()
	var res struct {
		ErrorText string `json:"errorText"`
	}
	if err := p.b.call(ctx, p.session, "Page.navigate", map[string]any{"url": url}, &res); err != nil {
		return err
	}
	if res.ErrorText != "" {
		return fmt.Errorf("browser: navigate to %s: %s", url, res.ErrorText)
	}
	// A load event of the page before can still be on its way: wait until
	// the document loaded is the one asked for.
	for {
		if err := p.wait(ctx, loaded, "the load of "+url); err != nil {
			return err
		}
		var state struct{ Href, Ready string }
		if err := p.Eval(ctx, `({Href: location.href, Ready: document.readyState})`, &state); err != nil {
			return err
		}
		if state.Href == url && state.Ready == "complete" {
			return nil
		}
	}
}

// Eval evaluates a JavaScript expression and stores its JSON value in out
// (nil to ignore it).
func (p *Page) Eval(ctx context.Context, expr string, out any) error {
	var res struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	if err := p.b.call(ctx, p.session, "Runtime.evaluate",
		map[string]any{"expression": expr, "returnByValue": true, "awaitPromise": true}, &res); err != nil {
		return err
	}
	if res.ExceptionDetails != nil {
		return fmt.Errorf("browser: %s: %s %s", expr, res.ExceptionDetails.Text, res.ExceptionDetails.Exception.Description)
	}
	if out == nil || len(res.Result.Value) == 0 {
		return nil
	}
	return json.Unmarshal(res.Result.Value, out)
}

// Text returns the trimmed text of the first element matching selector,
// or an error when there is none.
func (p *Page) Text(ctx context.Context, selector string) (string, error) {
	var s *string
	sel, _ := json.Marshal(selector)
	if err := p.Eval(ctx, fmt.Sprintf(`(() => { const e = document.querySelector(%s); return e ? e.textContent.trim() : null })()`, sel), &s); err != nil {
		return "", err
	}
	if s == nil {
		return "", fmt.Errorf("browser: no element matches %s", selector)
	}
	return *s, nil
}

// Do runs a JavaScript statement that leads to a new page (a click on a
// submit button or a link, a form's submit) and waits for that page to
// load.
func (p *Page) Do(ctx context.Context, js string) error {
	loaded, cancel := p.b.subscribe(p.session, "Page.loadEventFired")
	defer cancel()
	if err := p.Eval(ctx, js, nil); err != nil {
		return err
	}
	return p.wait(ctx, loaded, "the page after "+js)
}

// Click clicks the first element matching selector and waits for the page
// it leads to.
func (p *Page) Click(ctx context.Context, selector string) error {
	sel, _ := json.Marshal(selector)
	return p.Do(ctx, fmt.Sprintf(`(() => { const e = document.querySelector(%s); if (!e) throw new Error("no element matches " + %s); e.click() })()`, sel, sel))
}

// Screenshot returns a PNG of the whole page.
func (p *Page) Screenshot(ctx context.Context) ([]byte, error) {
	var res struct {
		Data string `json:"data"`
	}
	if err := p.b.call(ctx, p.session, "Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true}, &res); err != nil {
		return nil, err
	}
	return base64.StdEncoding.DecodeString(res.Data)
}
