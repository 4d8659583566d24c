#!/usr/bin/env bash
# Runs on a GPU machine (the device tool's `run`, from the repository root): `flexkv-bench ssd` against fio on the
# machine's local disk, at two block sizes, plus the rebuild times after kill -9 at 100K and 1M blocks. Logs and
# JSON under $OUT; the machine's disks and filesystems in $OUT/machine.txt.
# Bundle first (fio pulls in ceph/gluster libraries: too big to carry unpacked):
#   ../shared/tools/device-bundle.sh .device/ssdbundle build/flexkv-bench /usr/bin/fio
#   strip --strip-debug .device/ssdbundle/bin/* .device/ssdbundle/lib/*
#   (cd .device && tar -cJf ssdcarry/ssdbundle.tar.xz ssdbundle)     # carry: [".device/ssdcarry"]
set -uo pipefail
out=${OUT:-/tmp/flexkv-device-ssd}
mkdir -p "$out"
tar -xJf .device/ssdcarry/ssdbundle.tar.xz -C /tmp || { echo "cannot unpack the bundle"; exit 1; }
b=/tmp/ssdbundle
export LD_LIBRARY_PATH="$b/lib" PATH="$b/bin:$PATH"
dir=${DIR:-/var/tmp/flexkv-ssd-bench}
bytes=${BYTES:-8GiB}
rounds=${ROUNDS:-3}
blocks=${BLOCKS:-2MiB 256KiB}
rebuild=${REBUILD:-1}
{
  date -u; uname -a; nproc; free -g
  df -hT / /tmp /var/tmp /dev/shm
  lsblk -o NAME,SIZE,ROTA,TYPE,FSTYPE,MOUNTPOINT,MODEL 2>&1
  for q in /sys/block/*/queue/scheduler; do echo "$q: $(cat "$q")"; done
  findmnt -T /var/tmp
  fio --version
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"
status=0
for bs in $blocks; do
  mkdir -p "$dir-$bs"
  echo "== ssd bench, $bs blocks, $bytes, $rounds rounds"
  timeout 240 flexkv-bench ssd --dir "$dir-$bs" --block-size "$bs" --bytes "$bytes" --rounds "$rounds" --rebuild "" \
    >"$out/ssd-$bs.txt" 2>"$out/ssd-$bs.stderr" || { status=1; echo "FAILED ($bs)"; tail -n 20 "$out/ssd-$bs.stderr"; }
  cat "$out/ssd-$bs.txt"
done
[ "$rebuild" = 1 ] || exit $status
mkdir -p "$dir-rebuild"
echo "== rebuild after kill -9, 100K and 1M blocks"
timeout 200 flexkv-bench ssd --dir "$dir-rebuild" --bytes 1GiB --rounds 1 --no-fio --rebuild 100K,1M \
  >"$out/rebuild.txt" 2>"$out/rebuild.stderr" || { status=1; echo "FAILED (rebuild)"; tail -n 20 "$out/rebuild.stderr"; }
cat "$out/rebuild.txt"
exit $status
