#!/usr/bin/env bash
# Refresh the test environment's lock: a throwaway virtualenv installs `.[test,lab]` with no lock (whatever the
# registry serves today), and every package it ends up with is written, pinned with ==, to
# locks/sglang-VERSION.txt. scripts/test.sh installs with that file as constraints.
#   bash scripts/lock.sh [SGLANG_VERSION]     (default: the version setup.py pins; ~9 GB download, ~15 min)
# A lock for another SGLang version needs setup.py to accept that version first (pip refuses a conflict).
set -euo pipefail
cd "$(dirname "$0")/.."
pinned="$(sed -n 's/.*"sglang==\([^"]*\)".*/\1/p' setup.py)"
version="${1:-$pinned}"
[ -n "$version" ] || { echo "lock.sh: no SGLang version given and none pinned in setup.py" >&2; exit 2; }
lock="locks/sglang-$version.txt"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/sglang-dspine-lock.XXXXXX")"
trap 'rm -rf "$tmp" "$lock.tmp"' EXIT
python3 -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)
# The build backend's packages too: pip builds this package in an isolated environment that takes the newest
# setuptools/wheel, so the lock records the versions that environment gets today.
"${pip[@]}" install --no-cache-dir --upgrade setuptools wheel
"${pip[@]}" install --no-cache-dir -e ".[test,lab]" "sglang==$version"  # as scripts/test.sh installs it
mkdir -p locks
{
  echo "# Every package of the test environment (.[test,lab], SGLang $version), pinned; made by scripts/lock.sh"
  echo "# with $("$py" --version) on $(uname -sm), $(date -u +%Y-%m-%d). Used as constraints (-c) by scripts/test.sh."
  "${pip[@]}" freeze --all --exclude-editable --exclude sglang-dspine --exclude pip
} > "$lock.tmp"
mv "$lock.tmp" "$lock"
echo "wrote $lock ($(grep -c '==' "$lock") packages)"
