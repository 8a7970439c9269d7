//go:build !linux

package brokertest

import "syscall"

// deathSignal is the child's attributes: no parent-death signal outside
// Linux (the test's cleanup kills the child).
func deathSignal() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }
