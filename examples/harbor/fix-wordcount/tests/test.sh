#!/bin/bash
# The safe pattern for a reward the tested code cannot write:
#   1. each check runs the tested code in a process of its own, its output to a file of the check's
#      own, then stops and kills every process but this shell's ancestors (nothing the tested code
#      left running outlives its check), then compares what it printed here, in this shell (the
#      tested code's exit status and files decide nothing);
#   2. the reward is written last: if that write fails, test.sh fails, and a failed test.sh is 0.
cd /app
keep=" 1 "
p=$$
while [ "$p" -gt 1 ]; do keep="$keep$p "; p=$(awk '/^PPid:/ {print $2}' "/proc/$p/status"); done
kill_leftovers() {
  for signal in STOP KILL KILL; do
    for d in /proc/[0-9]*; do
      case "$keep" in *" ${d#/proc/} "*) ;; *) kill -s "$signal" "${d#/proc/}" 2>/dev/null ;; esac
    done
  done
}
passed=0
check() {  # expected count, text
  out=$(mktemp)
  timeout 20 python3 -c 'import sys; sys.path.insert(0, "/app")
from wordcount import count_words
print(repr(count_words(sys.argv[1])))' "$2" > "$out" 2>/dev/null
  kill_leftovers
  if [ "$(tail -n 1 "$out")" = "$1" ]; then passed=$((passed + 1)); fi
}
check 3 $'one\ttwo three'
check 4 $'one   two\nthree four'
check 0 ''
check 0 $'   \n '
echo "$passed" | awk '{ print $1 / 4 }' > /logs/verifier/reward.txt
