package brokertest

import "syscall"

// deathSignal is the child's attributes with Linux's parent-death signal:
// the kernel kills the child when the test binary dies.
func deathSignal() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
