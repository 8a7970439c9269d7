# modkit-go: run `make help` for the targets.
GO        ?= go
PKGS      ?= ./...
TESTFLAGS ?=
# Installs what a fresh machine lacks for a target (scripts/setup.sh says
# what); SETUP= skips it.
SETUP     ?= ./scripts/setup.sh

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets with one line each
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: test
test: ## Run the whole test suite with -race (starts a throwaway PostgreSQL unless DATABASE_URL is set)
	@$(if $(SETUP),$(SETUP) test)
	$(GO) test -race -count=1 -timeout 15m $(TESTFLAGS) $(PKGS)

.PHONY: demo
demo: ## Run the Mini Chat demo end to end (throwaway PostgreSQL unless DATABASE_URL is set)
	@$(if $(SETUP),$(SETUP) demo)
	$(GO) run ./examples/minichat/cmd/minichat

.PHONY: demo-payments
demo-payments: ## Run the payments demo: rail faults, a dispatcher SIGKILLed, reconciliation (throwaway PostgreSQL unless DATABASE_URL is set)
	@$(if $(SETUP),$(SETUP) demo)
	$(GO) run ./examples/payments/cmd/payments $(DEMOFLAGS)

.PHONY: bench
bench: ## Run both benchmark programs, one after the other: the outbox against raw SQL, then beside River
	@$(if $(SETUP),$(SETUP) demo)
	$(GO) run ./cmd/outbox-bench $(BENCHFLAGS)
	cd bench/river && $(GO) run . $(RIVERFLAGS)

.PHONY: bench-outbox
bench-outbox: ## Run the outbox against raw-SQL baselines and print its table (BENCHFLAGS=-help for options)
	@$(if $(SETUP),$(SETUP) demo)
	$(GO) run ./cmd/outbox-bench $(BENCHFLAGS)

.PHONY: bench-river
bench-river: ## Run the outbox and River v0.51.1 side by side (module bench/river; RIVERFLAGS=-help for options)
	@$(if $(SETUP),$(SETUP) demo)
	cd bench/river && $(GO) run . $(RIVERFLAGS)

.PHONY: soak
soak: ## Run the soak test: dispatchers killed, PostgreSQL restarted, nothing lost (SOAKFLAGS='-preset harsh', -help)
	@$(if $(SETUP),$(SETUP) demo)
	$(GO) run ./cmd/outbox-soak $(SOAKFLAGS)

.PHONY: lint
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2

lint: ## Check formatting (gofmt), run go vet and staticcheck (fetched through the Go module proxy)
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) run $(STATICCHECK) $(PKGS)
	cd bench/river && $(GO) vet ./... && $(GO) run $(STATICCHECK) ./...

.PHONY: tidy-check
tidy-check: ## Fail if go.mod/go.sum are not tidy
	$(GO) mod tidy -diff
