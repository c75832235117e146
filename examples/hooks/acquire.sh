#!/bin/sh
# on_acquire: runs when a device goes from free to held, before the lease's
# first job starts on it (see `on_acquire` in docs/configuration.md).
#
# This example puts the device's GPU in EXCLUSIVE_PROCESS compute mode, so
# the leased job is the only CUDA context on it, and makes a fresh scratch
# directory for the lease.
#
# The worker runs it with:
#   RC_HOOK               on_acquire
#   RC_DEVICE             the device name from the config (gpu1)
#   RC_HOST               this host's name
#   RC_JOB_ID             the job the lease starts with
#   CUDA_VISIBLE_DEVICES  the GPU's UUID (or index) when the device is a GPU
# plus the worker's own environment without its RC_* settings and token.
# stdin is /dev/null; stdout and stderr are logged (stderr's tail becomes the
# failure reason).
#
# Exit 0 to accept the lease. Anything else, or running past the hook
# `timeout`, refuses the job and quarantines the device until `rc clear`.
# Do not leave processes behind: a hook is for quick, bounded setup.
set -eu

device="${RC_DEVICE:?RC_DEVICE is not set; run by rc-worker as on_acquire}"
scratch_root="${RC_SCRATCH_ROOT:-/var/tmp/rc-scratch}"

if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
    # Needs root; fails loudly (and so refuses the lease) if it cannot be set.
    nvidia-smi -i "$CUDA_VISIBLE_DEVICES" -c EXCLUSIVE_PROCESS >&2
fi

mkdir -p "$scratch_root"
rm -rf "${scratch_root:?}/$device"
mkdir -m 1777 "$scratch_root/$device"
echo "acquire: $device ready for job ${RC_JOB_ID:-?} (scratch $scratch_root/$device)" >&2
