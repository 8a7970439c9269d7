//go:build !race

package brokertest

// raceEnabled: the binary is built with the race detector.
const raceEnabled = false
