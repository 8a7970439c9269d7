package main

import "context"

func runServe(ctx context.Context, e env, args []string) error {
	return usageErr("serve: not built yet")
}
