#!/usr/bin/env bash
# The README's test command: set up the venv, then run the default suite.
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
# Three tests need a Debian package: the HTML view's drives a real headless Chromium, the
# etcd store's run a real etcd server, the status server's a real Prometheus. Install each
# once, quietly, where we may (CI runs as root); without it those tests skip.
install_for_tests() {  # program, package, which tests skip without it
    if ! command -v "$1" >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -qq "$2" || { apt-get update -qq && apt-get install -y -qq "$2"; }; } \
            >/dev/null 2>&1 || echo "tests/run.sh: could not install $2; $3 will skip" >&2
    fi
}
install_for_tests chromium chromium "the HTML view test"
install_for_tests etcd etcd-server "the etcd store tests"
install_for_tests prometheus prometheus "the Prometheus scrape test"
exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
