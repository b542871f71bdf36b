#!/bin/bash
# The reward goes last, whatever happened before: nothing the tested workspace wrote survives it.
if [ -f /app/hello.txt ] && [ ! -L /app/hello.txt ] && [ "$(cat /app/hello.txt)" = "Hello, world!" ]; then
  reward=1
else
  reward=0
fi
echo "$reward" > /logs/verifier/reward.txt
