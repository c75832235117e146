#!/bin/sh
# A stand-in for nvidia-smi in tests, installed as "nvidia-smi" on a test PATH.
#   FAKE_SMI_OUTPUT  file whose contents it prints (the fixture)
#   FAKE_SMI_RC      exit status (default 0)
#   FAKE_SMI_STDERR  if set, print the fixture on stderr instead of stdout
#   FAKE_SMI_SLEEP   seconds to hang before printing (a wedged driver)
#   FAKE_SMI_LOG     file to record its arguments and pid in
if [ -n "$FAKE_SMI_LOG" ]; then
    echo "$$ $*" >> "$FAKE_SMI_LOG"
fi
if [ -n "$FAKE_SMI_SLEEP" ]; then
    sleep "$FAKE_SMI_SLEEP"
fi
if [ -n "$FAKE_SMI_OUTPUT" ]; then
    if [ -n "$FAKE_SMI_STDERR" ]; then
        cat "$FAKE_SMI_OUTPUT" >&2
    else
        cat "$FAKE_SMI_OUTPUT"
    fi
fi
exit "${FAKE_SMI_RC:-0}"
