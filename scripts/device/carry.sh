#!/usr/bin/env bash
# Files larger than one device call's 64 MiB reach the GPU machine in pieces over back-to-back calls of one lease
# (the machine keeps /tmp while it stays warm, ~30 s after a call).
# Here (repo root):
#   bash scripts/device/carry.sh pack NAME FILE      # FILE, xz-compressed, in pieces of PIECE_MIB (default 38: a call carries 64 MiB, the tree ~25 MB of it)
#                                                    # under .carry-store/NAME/ with sha256 sums of each and all
#   bash scripts/device/carry.sh resplit NAME        # the same compressed file cut again at PIECE_MIB (when the
#                                                    # tree that travels with each piece grew), no recompression
#   bash scripts/device/carry.sh size [PATH ...]     # what a call carrying PATHs takes of the 64 MiB (exit 1 over it)
#   bash scripts/device/carry.sh aside / back        # models/ and benchmarks/results/ out of the tree that travels
#                                                    # (1.6 MiB instead of 25: 61 MiB pieces) and back afterwards
#   bash scripts/device/carry.sh stage NAME K [NAME K ...]  # puts piece K (1-based) and the sums into .carry/ (the
#                                                    # only things there): carry ".carry" in the next device call
# There (repo root, any call of the lease):
#   bash scripts/device/carry.sh receive [DIR ...]   # checks each carried piece's sha256 (in .carry, or in the DIRs:
#                                                    # pieces carried straight from .carry-store/NAME/ with their sums,
#                                                    # no stage step), keeps it in /tmp/carry/; one received by an
#                                                    # earlier call of the lease is skipped
#   bash scripts/device/carry.sh assemble NAME DEST  # all pieces present and checked: joins, checks the whole
#                                                    # compressed file, decompresses to DEST (xz -T0: the pack's
#                                                    # blocks in parallel)
# Each step prints one line and fails (exit 1) on a missing piece or a wrong hash.
set -euo pipefail
store="${CARRY_STORE:-.carry-store}" stage="${CARRY_STAGE:-.carry}" there="${CARRY_THERE:-/tmp/carry}"
case "${1:-}" in
  pack)
    name="${2:?NAME}" file="${3:?FILE}"
    rm -rf "${store:?}/$name" && mkdir -p "$store/$name"
    xz -6 -T0 -c "$file" >"$store/$name/$name.xz"
    (cd "$store/$name" && split -b "$(( ${PIECE_MIB:-38} * 1024 * 1024 ))" -d -a 2 "$name.xz" "$name.xz.part" \
      && sha256sum "$name.xz" "$name".xz.part* >"$name.sha256" && rm "$name.xz")
    n=$(ls "$store/$name"/*.part* | wc -l)
    echo "carry.sh: $file -> $n pieces in $store/$name ($(du -sh "$store/$name" | cut -f1) compressed)"
    ;;
  resplit)
    name="${2:?NAME}"
    [ -f "$store/$name/$name.sha256" ] || { echo "carry.sh: nothing packed as $name in $store" >&2; exit 1; }
    (cd "$store/$name" && sha256sum -c --quiet <(grep part "$name.sha256")) \
      || { echo "carry.sh: $name: pieces missing or wrong" >&2; exit 1; }
    (cd "$store/$name" && cat "$name".xz.part* >"$name.xz" && sha256sum -c --quiet <(grep -v part "$name.sha256") \
      && rm "$name".xz.part* && split -b "$(( ${PIECE_MIB:-38} * 1024 * 1024 ))" -d -a 2 "$name.xz" "$name.xz.part" \
      && sha256sum "$name.xz" "$name".xz.part* >"$name.sha256" && rm "$name.xz") \
      || { echo "carry.sh: $name: resplit failed" >&2; exit 1; }
    echo "carry.sh: $name cut again into $(ls "$store/$name"/*.part* | wc -l) pieces of ${PIECE_MIB:-38} MiB"
    ;;
  stage)
    [ $# -ge 3 ] && [ $(( ($# - 1) % 2 )) = 0 ] || { echo "carry.sh: stage NAME K [NAME K ...]" >&2; exit 2; }
    rm -rf "$stage" && mkdir -p "$stage"
    shift
    while [ $# -gt 0 ]; do  # several pieces (of one or more files) in one call, where they fit beside the tree
      name="$1" k="$2"; shift 2
      piece="$(printf '%s/%s/%s.xz.part%02d' "$store" "$name" "$name" "$((k - 1))")"
      [ -f "$piece" ] || { echo "carry.sh: no piece $k of $name ($piece)" >&2; rm -rf "$stage"; exit 1; }
      cp "$piece" "$store/$name/$name.sha256" "$stage/"
      echo "carry.sh: $stage holds piece $k of $name ($(du -h "$piece" | cut -f1))"
    done
    echo "carry.sh: $(du -sh "$stage" | cut -f1) staged: carry \".carry\" next call"
    ;;
  receive)
    mkdir -p "$there"
    shift
    found=0
    for piece in $(for d in "${@:-$stage}"; do ls -d "$d"/*.part* 2>/dev/null; done); do
      found=1
      dir="$(dirname "$piece")" base="$(basename "$piece")" name="${base%.xz.part*}"
      if [ -f "$there/$base" ] && [ "$(stat -c %s "$there/$base")" = "$(stat -c %s "$piece")" ]; then
        continue  # received (and checked) by an earlier call of the lease; assemble checks every piece again
      fi
      cp "$dir/$name.sha256" "$there/"
      want="$(awk -v f="$base" '$2 == f {print $1}' "$there/$name.sha256")"
      got="$(sha256sum "$piece" | cut -d' ' -f1)"
      [ -n "$want" ] && [ "$want" = "$got" ] || { echo "carry.sh: $base: sha256 $got, expected ${want:-none}" >&2; exit 1; }
      cp "$piece" "$there/"
      echo "carry.sh: received $base (sha256 ok); $(ls "$there/$name".xz.part* | wc -l) of $(grep -c part "$there/$name.sha256") pieces of $name here"
    done
    [ "$found" = 1 ] || { echo "carry.sh: nothing carried in ${*:-$stage}" >&2; exit 1; }
    ;;
  assemble)
    name="${2:?NAME}" dest="${3:?DEST}"
    [ -f "$there/$name.sha256" ] || { echo "carry.sh: no piece of $name received" >&2; exit 1; }
    (cd "$there" && sha256sum -c --quiet <(grep part "$name.sha256")) \
      || { echo "carry.sh: $name: pieces missing or wrong" >&2; exit 1; }
    cat "$there/$name".xz.part* >"$there/$name.xz"
    (cd "$there" && sha256sum -c --quiet <(grep -v part "$name.sha256")) \
      || { echo "carry.sh: $name: the joined file's sha256 is wrong" >&2; exit 1; }
    mkdir -p "$(dirname "$dest")" && xz -dc -T0 "$there/$name.xz" >"$dest.tmp" && mv "$dest.tmp" "$dest"
    echo "carry.sh: $name assembled into $dest ($(du -h "$dest" | cut -f1))"
    ;;
  size)  # here, before a call: what it carries against the device's 64 MiB (tracked and untracked-not-ignored files
          # that exist, shared/ where there is one, and the carry PATHs), so a refused call costs no lease time
    shift
    limit=$(( ${CARRY_LIMIT_MIB:-64} * 1024 * 1024 ))
    tree=$( { git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null || true; } \
      | awk '{s += $1} END {print s + 0}')
    extra=0
    # shared/ travels whether git ignores it or not; not ignored, the tree's sum has it already
    for p in "$@" $( [ -d shared ] && git check-ignore -q shared && echo shared ); do
      [ -e "$p" ] || { echo "carry.sh: carry path $p is not here" >&2; exit 1; }
      extra=$(( extra + $(du -sb "$p" | cut -f1) ))
    done
    mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
    echo "carry.sh: a call carries $(mib $(( tree + extra ))) MiB of $(mib "$limit") (tree $(mib "$tree"), carried $(mib "$extra"))"
    if [ $(( tree + extra )) -gt "$limit" ]; then
      echo "carry.sh: over the limit: set the results aside for the call (CARRY_ASIDE=benchmarks/results" \
        "bash scripts/device/carry.sh aside; back after), or carry less" >&2
      exit 1
    fi
    ;;
  aside)  # here, before the piece calls: the tree's bulk out of the way (into ignored .carry-aside/), so pieces
           # can be larger; `back` after the last piece call, before anything else (git status shows them deleted)
    [ -e .carry-aside ] && { echo "carry.sh: .carry-aside exists (aside already? run: carry.sh back)" >&2; exit 1; }
    mkdir -p .carry-aside
    for p in ${CARRY_ASIDE:-models benchmarks/results}; do
      [ -e "$p" ] || continue
      mkdir -p ".carry-aside/$(dirname "$p")" && mv "$p" ".carry-aside/$p"
      echo "carry.sh: $p set aside"
    done
    ;;
  back)
    [ -d .carry-aside ] || { echo "carry.sh: nothing set aside" >&2; exit 1; }
    for p in ${CARRY_ASIDE:-models benchmarks/results}; do
      [ -e ".carry-aside/$p" ] || continue
      [ -e "$p" ] && { echo "carry.sh: $p exists here and in .carry-aside: left both, resolve by hand" >&2; exit 1; }
      mv ".carry-aside/$p" "$p" && echo "carry.sh: $p back"
    done
    rm -rf .carry-aside
    ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
