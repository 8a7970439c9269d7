//go:build !linux

package pgserver

import "syscall"

// setDeathSignal does nothing where the kernel has no parent-death signal:
// a server outlives a test binary killed with SIGKILL there, and the next
// run removes its directory (see Start).
func setDeathSignal(*syscall.SysProcAttr, syscall.Signal) {}
