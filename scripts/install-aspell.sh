#!/bin/sh
# The spell gate needs aspell with its English dictionary. Install them when
# we can (root on Debian/Ubuntu), otherwise say exactly what is missing.
set -e
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "aspell or its English dictionary is missing: installing aspell aspell-en with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q aspell aspell-en >/dev/null || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q aspell aspell-en >/dev/null; }
else
  echo "error: the spell gate needs aspell and its English dictionary." >&2
  echo "       On Debian/Ubuntu: sudo apt-get install aspell aspell-en" >&2
  echo "       On macOS:         brew install aspell" >&2
  exit 1
fi
command -v aspell >/dev/null && aspell dump dicts | grep -qx en
