#!/usr/bin/env bash
# Source it. stop_session SID [stacks]: stops every process of the session SID (a command started with
# `setsid CMD &` leads a session whose id is its pid: SGLang's launcher, scheduler and detokenizer inherit it) and
# nothing outside it. Other servers on the GPU (a soak beside, another job's) match the same command-line patterns
# and are left alone: a `pkill -f sglang.launch_server` here killed the soak at stop 47.
# `stacks` first sends SIGABRT to the session's sglang processes (PYTHONFAULTHANDLER prints every thread's stack).
stop_session() {
  local sid="${1:?stop_session SID [stacks]}" i
  if [ "${2:-}" = stacks ]; then pkill -ABRT -s "$sid" -f sglang 2>/dev/null; sleep 5; fi
  pkill -TERM -s "$sid" 2>/dev/null
  for i in 1 2 3 4 5 6; do _session_live "$sid" || return 0; sleep 0.5; done
  pkill -KILL -s "$sid" 2>/dev/null; sleep 1
  ! _session_live "$sid"
}
_session_live() {  # a process of session $1 that is not a zombie (a killed child its parent has not reaped)
  ps -o stat= -s "$1" 2>/dev/null | grep -qv '^Z'
}
