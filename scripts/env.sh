# Sourced by scripts/serve.sh and scripts/test.sh: a virtualenv is (re)installed only when what it is installed
# from changed (the lock, setup.py, the calling script), so a second run starts at once instead of re-running pip.
# The key is written after a successful install; an interrupted install leaves none and runs again.

# env_key FILE...: one hash of the files' contents (a missing file counts as empty, e.g. an optional .imports) and
# of this checkout's path (the editable install points at it: a virtualenv copied from elsewhere installs again)
env_key() {
  local f
  {
    pwd -P
    for f in "$@"; do
      printf '%s\n' "$f"
      [ -f "$f" ] && cat "$f"
    done
  } | sha256sum | cut -d' ' -f1
}

# env_current VENV KEY: true when VENV holds an install made under KEY
env_current() {
  [ -x "$1/bin/python" ] && [ -f "$1/.sglang-dspine-env" ] && [ "$(cat "$1/.sglang-dspine-env")" = "$2" ]
}

# env_mark VENV KEY: record that VENV's install under KEY finished
env_mark() {
  printf '%s\n' "$2" >"$1/.sglang-dspine-env"
}
