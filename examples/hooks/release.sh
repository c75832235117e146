#!/bin/sh
# on_release: runs when a held device is released, after the last job of the
# lease and `release_linger` (see `on_release` in docs/configuration.md).
#
# This example undoes hooks/acquire.sh: the GPU goes back to DEFAULT compute
# mode and the lease's scratch directory is removed.
#
# Same environment as on_acquire (RC_HOOK=on_release, RC_DEVICE, RC_HOST,
# RC_JOB_ID of the lease's last job, CUDA_VISIBLE_DEVICES for a GPU).
#
# Exit 0 and the device is free again. Anything else, or running past the
# hook `timeout`, quarantines the device until `rc clear`: a release that
# could not clean up must not hand the device to the next user.
set -eu

device="${RC_DEVICE:?RC_DEVICE is not set; run by rc-worker as on_release}"
scratch_root="${RC_SCRATCH_ROOT:-/var/tmp/rc-scratch}"

if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -i "$CUDA_VISIBLE_DEVICES" -c DEFAULT >&2
fi

rm -rf "${scratch_root:?}/$device"
echo "release: $device cleaned up" >&2
