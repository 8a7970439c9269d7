#!/usr/bin/env bash
# Installs what `make test` or `make demo` needs and a fresh Debian machine
# lacks, and nothing else: PostgreSQL's server binaries (for the throwaway
# cluster, unless a database URL is set), and for the tests a C compiler
# (go test -race needs cgo) and Chromium (the dashboard's browser tests).
# Installing takes root and apt-get; without them it says what to install.
#
# Usage: scripts/setup.sh test|demo
set -euo pipefail

mode=${1:-}
case "$mode" in
test | demo) ;;
*)
	echo "usage: $0 test|demo" >&2
	exit 2
	;;
esac

updated=
apt_install() { # apt_install WHAT PACKAGE...
	local what=$1
	shift
	if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
		echo "setup: missing $what; install it (on Debian/Ubuntu: sudo apt-get install $*) and run this again" >&2
		return 1
	fi
	echo "setup: missing $what; installing $* with apt-get" >&2
	export DEBIAN_FRONTEND=noninteractive
	if [ -z "$updated" ]; then
		apt-get update -qq
		updated=1
	fi
	apt-get install -y -qq "$@" >/dev/null
}

have_pg_binaries() {
	command -v initdb >/dev/null 2>&1 && return 0
	compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

# The throwaway cluster is started only when no database is given.
url=${DATABASE_URL:-}
if [ "$mode" = test ]; then
	url=${TEST_DATABASE_URL:-${DATABASE_URL:-}}
fi
if [ -z "$url" ] && ! have_pg_binaries; then
	apt_install "PostgreSQL's server binaries (initdb, postgres)" postgresql
fi

if [ "$mode" = test ]; then
	# -race needs cgo, and cgo a C compiler: without one Go turns cgo off
	# and every package fails to build.
	if [ "$(go env CGO_ENABLED 2>/dev/null)" != 1 ] || ! command -v "$(go env CC 2>/dev/null || echo gcc)" >/dev/null 2>&1; then
		apt_install "a C compiler (go test -race needs cgo)" gcc libc6-dev
	fi
	# The dashboard's browser tests; without Chromium they are skipped.
	if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
		apt_install "Chromium (the dashboard's browser tests)" chromium ||
			echo "setup: the dashboard's browser tests will be skipped" >&2
	fi
fi
