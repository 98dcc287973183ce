#!/usr/bin/env bash
# Refresh a test environment's lock, locks/sglang-VERSION.txt: every package of a throwaway virtualenv, pinned with
# ==. scripts/test.sh installs with it.
#   bash scripts/lock.sh [SGLANG_VERSION]     (default: the first of setup.py's SGLANG_RELEASES, the GPU-verified one)
# Two kinds of environment:
# - full (no locks/sglang-VERSION.imports): `.[test,lab]` and SGLang with all its dependencies, as the registry
#   resolves them today (~9 GB download, ~15 min). test.sh uses the lock as constraints.
# - import-time (locks/sglang-VERSION.imports exists): SGLang without its dependencies, torch, transformers and
#   tokenizers at SGLang's pins with theirs, pytest, and exactly the packages the .imports file lists (each at
#   the version written there, which must be SGLang's pin where it has one). For an SGLang whose dependencies
#   do not fit the machines it is tested on; test.sh installs exactly the lock and runs the SGLang tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh  # sglang_releases: setup.py's list, read in one place
releases="$(sglang_releases)"
version="${1:-${releases%% *}}"
case " $releases " in
  *" $version "*) ;;
  *) echo "lock.sh: SGLang '$version' is not one of setup.py's SGLANG_RELEASES ($releases)" >&2; exit 2 ;;
esac
lock="locks/sglang-$version.txt"
imports="locks/sglang-$version.imports"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/sglang-dspine-lock.XXXXXX")"
trap 'rm -rf "$tmp" "$lock.tmp"' EXIT
python3 -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check -q)
# The build backend's packages too: pip builds this package in an isolated environment that takes the newest
# setuptools/wheel, so the lock records the versions that environment gets today.
"${pip[@]}" install --no-cache-dir --upgrade setuptools wheel
if [ -f "$imports" ]; then
  kind="import-time: SGLang --no-deps, the packages of $imports"
  "${pip[@]}" install --no-cache-dir --no-deps "sglang==$version"
  # SGLang's exact pins (name==version), for the names given, from its installed metadata.
  sglang_pins() {
    "$py" - "$@" <<'EOF'
import re, sys
from importlib.metadata import requires

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

pins = {}
for req in requires("sglang") or []:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*==\s*([^\s;,]+)\s*(;.*)?$", req)
    if m and "extra ==" not in (m.group(4) or ""):
        pins[norm(m.group(1))] = m.group(3)
for name in sys.argv[1:]:
    print(f"{name}=={pins[norm(name)]}" if norm(name) in pins else name)
EOF
  }
  "${pip[@]}" install --no-cache-dir $(sglang_pins torch transformers tokenizers) safetensors tqdm pytest
  # The listed packages must agree with SGLang's pins: a different version would test another environment.
  while read -r req; do
    name="${req%%==*}"
    want="$(sglang_pins "$name")"
    if [ "$want" != "$name" ] && [ "$want" != "$req" ]; then
      echo "lock.sh: $imports: $req, but SGLang $version pins $want" >&2
      exit 2
    fi
  done < <(grep -v '^#' "$imports" | grep .)
  "${pip[@]}" install --no-cache-dir --no-deps -r "$imports"
  "${pip[@]}" install --no-cache-dir --no-deps -e .  # as scripts/test.sh installs it
else
  kind=".[test,lab], SGLang $version and its dependencies"
  "${pip[@]}" install --no-cache-dir -e ".[test,lab]" "sglang==$version"  # as scripts/test.sh installs it
fi
mkdir -p locks
{
  echo "# Every package of the test environment ($kind), pinned; made by scripts/lock.sh"
  echo "# with $("$py" --version) on $(uname -sm), $(date -u +%Y-%m-%d). Used by scripts/test.sh."
  "${pip[@]}" freeze --all --exclude-editable --exclude sglang-dspine --exclude pip
} > "$lock.tmp"
mv "$lock.tmp" "$lock"
echo "wrote $lock ($(grep -c '==' "$lock") packages)"
