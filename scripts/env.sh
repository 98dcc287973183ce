# Sourced by scripts/serve.sh, scripts/test.sh, scripts/lock.sh and .ci/run: setup.py's release list
# (sglang_releases), and a virtualenv (re)installed only when what it is installed from changed (the lock,
# setup.py, the calling script), so a second run starts at once instead of re-running pip. The key is written
# after a successful install; an interrupted install leaves none and runs again.

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

# sglang_releases: setup.py's SGLANG_RELEASES, space-separated; the first is the GPU-verified one, the default
sglang_releases() {
  sed -n 's/^SGLANG_RELEASES = \[\(.*\)\]/\1/p' setup.py | tr -d '",'
}

# serve_lock, serve_env_key: the lock scripts/serve.sh installs .venv from (the default release's) and the key it
# marks that install with
serve_lock() {
  local releases
  releases="$(sglang_releases)"
  printf 'locks/sglang-%s.txt\n' "${releases%% *}"
}
serve_env_key() {
  env_key "$(serve_lock)" setup.py scripts/serve.sh
}

# env_current VENV KEY: true when VENV holds an install made under KEY
env_current() {
  [ -x "$1/bin/python" ] && [ -f "$1/.sglang-dspine-env" ] && [ "$(cat "$1/.sglang-dspine-env")" = "$2" ]
}

# env_mark VENV KEY: record that VENV's install under KEY finished
env_mark() {
  printf '%s\n' "$2" >"$1/.sglang-dspine-env"
}
