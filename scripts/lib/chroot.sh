# shellcheck shell=bash
# The lock and the mounts of a Debian chroot with the repository bind-mounted read-only inside,
# shared by scripts/libtorch2-check.sh and scripts/fsdp2-cpu-compare.sh (one copy of the code that
# decides what is mounted, and when it is unmounted). Source it, set CHROOT (absolute, no trailing
# slash), then:
#
#   chroot_lock NAME          one run per chroot at a time: holds $CHROOT.lock on fd 9 until the
#                             script exits (NAME prefixes the "waiting" line)
#   chroot_mounts_under DIR   mount points at or under DIR, deepest first (/proc/self/mountinfo)
#   chroot_unmount_all        unmounts everything at or under $CHROOT (lazily when busy)
#   chroot_mount REPO DEST    proc, sys, dev, dev/pts, dev/shm, and REPO read-only at $CHROOT$DEST;
#                             copies the host's resolv.conf in
#   chroot_run VAR=V... -- CMD...
#                             CMD inside with a clean environment (PATH, HOME, LANG, TERM,
#                             DEBIAN_FRONTEND) plus the VAR=V given before "--"
#
# Needs root. Nothing here runs on sourcing.

chroot_mounts_under() {
  awk -v root="$1" '{ p = $5; gsub(/\\040/, " ", p); if (p == root || index(p, root "/") == 1) print p }' \
    /proc/self/mountinfo | sort -r
}

chroot_unmount_all() {
  local m
  for m in $(chroot_mounts_under "$CHROOT"); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}

chroot_lock() {
  mkdir -p "$(dirname "$CHROOT")"
  exec 9>"$CHROOT.lock"
  if ! flock -n 9; then
    printf '%s: waiting for another run using %s\n' "$1" "$CHROOT"
    flock 9
  fi
}

chroot_mount() {
  local repo="$1" dest="$2"
  mkdir -p "$CHROOT/proc" "$CHROOT/sys" "$CHROOT/dev" "$CHROOT$dest"
  mount -t proc proc "$CHROOT/proc"
  mount -t sysfs sysfs "$CHROOT/sys"
  mount --bind /dev "$CHROOT/dev"
  mount --bind /dev/pts "$CHROOT/dev/pts"
  if mountpoint -q /dev/shm; then mount --bind /dev/shm "$CHROOT/dev/shm"; fi
  mount --bind "$repo" "$CHROOT$dest"
  mount -o remount,bind,ro "$CHROOT$dest"
  # debootstrap's copy can be stale; name resolution inside needs the host's.
  cp -L /etc/resolv.conf "$CHROOT/etc/resolv.conf" 2>/dev/null || true
}

chroot_run() {
  local extra=()
  while (($#)) && [ "$1" != -- ]; do extra+=("$1"); shift; done
  [ "${1:-}" = -- ] && shift
  env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive TERM="${TERM:-dumb}" "${extra[@]}" chroot "$CHROOT" "$@"
}
