package pgserver

import "syscall"

// setDeathSignal has the kernel send sig to the child when the thread that
// started it ends (Linux's PR_SET_PDEATHSIG), so that a killed test binary
// leaves no server behind.
func setDeathSignal(a *syscall.SysProcAttr, sig syscall.Signal) { a.Pdeathsig = sig }
