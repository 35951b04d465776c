#!/usr/bin/env bash
# The README's test command: set up the venv, then run the default suite.
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
# The HTML view's test drives a real headless Chromium (Debian's package); install it
# once, quietly, where we may (CI runs as root). Without it that one test is skipped.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq chromium || { apt-get update -qq && apt-get install -y -qq chromium; }; } \
        >/dev/null 2>&1 || echo "tests/run.sh: could not install chromium; the HTML view test will skip" >&2
fi
exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
