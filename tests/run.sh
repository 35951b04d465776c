#!/usr/bin/env bash
# The README's test command: set up the venv, then run the default suite.
source "$(dirname "${BASH_SOURCE[0]}")/../launch/env.sh"
exec python -m pytest -q -p no:cacheprovider "$@"
