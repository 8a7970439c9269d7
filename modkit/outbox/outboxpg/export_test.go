package outboxpg

import "time"

// SetListenCheck sets how long the listener waits quietly before it checks
// its connection, and how long it waits for the check to come back, until
// the test ends (cleanup restores them).
func SetListenCheck(quiet, echoWait time.Duration) (restore func()) {
	q, e := listenQuiet, listenEchoWait
	listenQuiet, listenEchoWait = quiet, echoWait
	return func() { listenQuiet, listenEchoWait = q, e }
}
