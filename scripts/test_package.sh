#!/usr/bin/env bash
# The Debian package end to end (issue 18): builds flexkvd_<version>_amd64.deb from an existing build directory
# (cpack; no second build), installs it with dpkg, checks its metadata and file list, starts the INSTALLED flexkvd
# exactly as the installed flexkvd.service says (ExecStart=, User=, Group=, UMask=, limits, environment, runtime and
# cache directories, READY=1; systemd is not PID 1 in CI, so this script plays its part), reaches it with the
# installed flexkvctl, the installed Python package and the example engine project built against the installed files
# (find_package and pkg-config), reinstalls the package over the running daemon (as an upgrade would: the daemon, its
# cache and the operator's config stay), stops it, removes the package (config, pool and user stay), purges it and
# checks that only what policy keeps is left.
# The unit's sandbox (ProtectSystem=, DevicePolicy=, SystemCallFilter=, ...) needs systemd itself and is not applied
# here; tests/integration/systemd_verify.sh checks those settings.
#
#   scripts/test_package.sh [BUILD_DIR]     (default build/; root; scripts/test.sh runs it through
#                                            tests/scripts/test_package_over_leftovers_test.sh)
# Prints SKIP and exits 0 when not root, without dpkg, or when the host already has flexkvd installed or a flexkvd
# running on its directories (the test would replace them); under CI=true each of those is a failure that says why,
# since CI must test the package. What an earlier run of this project's own daemon left behind under the package's
# paths (scripts/run.sh, or build/flexkvd run as root, leaves /run/flexkvd; a pool made with --pool-path
# /dev/shm/flexkvd/pool leaves that directory; no daemon on them) is moved aside for the test and put back
# afterwards, never deleted. (run.sh's own pools, /dev/shm/flexkvd-<N>, are not the package's paths: untouched.)
# FLEXKV_SKIPS_FILE: a file the reason of a skip is appended to (scripts/test.sh lists them at its end). Leaves the
# machine as it found it, on failure too: the daemon is stopped, the package purged, what was moved aside put back,
# and the user and groups it created are deleted (trap).
set -euo pipefail  # hence no `| grep -q`: a writer killed by SIGPIPE would fail a match
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=$(cd "${1:-build}" && pwd)

fail() { echo "FAIL scripts/test_package.sh: $*" >&2; exit 1; }
skip() {
  [[ ${CI:-} != true ]] || fail "cannot run in CI: $*"
  echo "SKIP scripts/test_package.sh: $*" >&2
  [[ -z ${FLEXKV_SKIPS_FILE:-} ]] || echo "Debian package test (scripts/test_package.sh): $*" >>"$FLEXKV_SKIPS_FILE"
  exit 0
}
step() { echo "test_package: $*" >&2; }

[[ $(id -u) -eq 0 ]] || skip "needs root (dpkg -i, the flexkv system user, files under /usr and /etc)"
for tool in dpkg dpkg-deb dpkg-query dpkg-shlibdeps cpack setpriv prlimit; do
  command -v "$tool" >/dev/null || skip "$tool is absent (dpkg and dpkg-dev, cmake, util-linux)"
done
[[ -f $BUILD/CPackConfig.cmake ]] || fail "$BUILD/CPackConfig.cmake is missing: configure and build $BUILD first"
if dpkg-query -W -f='${Status}' flexkvd 2>/dev/null | grep -v '^unknown ok not-installed$' >/dev/null; then
  skip "a flexkvd package is already on this host ($(dpkg-query -W -f='${Version} ${Status}' flexkvd)); not replacing it"
fi
for path in /usr/bin/flexkvd /etc/flexkvd /var/cache/flexkvd; do
  [[ ! -e $path ]] || skip "$path already exists on this host (another flexkvd install?); the test would replace it"
done
# A process with a file under these open, mapped or as its directory (a flexkvd serving from them).
holders() {  # <path>: prints "pid (comm)" of each process that holds a file under it
  local link pid
  # find exits 1 for the processes that ended while it read /proc: only what it printed counts.
  { find /proc/[0-9]*/cwd /proc/[0-9]*/fd /proc/[0-9]*/map_files -maxdepth 1 \( -lname "$1" -o -lname "$1/*" \) \
      2>/dev/null || true; } | while read -r link; do
    pid=${link#/proc/}
    pid=${pid%%/*}
    echo "$pid ($(cat /proc/"$pid"/comm 2>/dev/null))"
  done | sort -u
}
# Left by an earlier run of the source-built daemon: moved aside on the same filesystem (a rename), put back by
# cleanup. A daemon still running on them is another matter: the test would pull its pool from under it.
# A run of this test that was killed (SIGKILL: no cleanup) left what it moved aside: put it back first.
for stale in /run/.flexkvd-aside.* /dev/shm/.flexkvd-aside.*; do
  [[ -e $stale ]] || continue
  original=$(dirname "$stale")/flexkvd
  if [[ -e $original ]]; then
    skip "$stale (moved aside by a killed run of this test) and $original both exist: keep the one you need"
  fi
  mv "$stale" "$original"
  echo "test_package: put $original back (moved aside by an earlier run of this test that was killed)" >&2
done
aside=()
ours=(/var/cache/flexkvd)  # absent (checked above), so whatever is there at the end is the package's
for path in /run/flexkvd /dev/shm/flexkvd; do
  [[ -e $path ]] || ours+=("$path")
done
for path in /run/flexkvd /dev/shm/flexkvd; do
  [[ -e $path ]] || continue
  held=$(holders "$path")
  [[ -z $held ]] || skip "$path is in use by a running process: $(tr '\n' ' ' <<<"$held")(stop that flexkvd first)"
done

# What the package will create and policy keeps on purge (the user and groups): deleted at the end only if new.
had_user=0 had_group=0 had_admin_group=0
getent passwd flexkv >/dev/null && had_user=1
getent group flexkv >/dev/null && had_group=1
getent group flexkv-admin >/dev/null && had_admin_group=1
TMP=$(mktemp -d /tmp/flexkv-package.XXXXXX)
chmod 0755 "$TMP"
daemon_pid="" notify_pid=""

stop_daemon() {
  [[ -n $daemon_pid ]] || return 0
  if kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 450); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$daemon_pid" 2>/dev/null || true
  fi
  wait "$daemon_pid" 2>/dev/null || true
  daemon_pid=""
}
cleanup() {
  local rc=$?
  set +e
  stop_daemon
  [[ -z $notify_pid ]] || kill "$notify_pid" 2>/dev/null
  if dpkg-query -W -f='${Status}' flexkvd 2>/dev/null | grep -v '^unknown ok not-installed$' >/dev/null; then
    echo "test_package: cleanup: dpkg --purge flexkvd" >&2
    dpkg --purge flexkvd >/dev/null
  fi
  # Only what this test made goes: a path that was absent at the start, or whose own content is safe aside.
  local path entry
  for path in "${ours[@]}"; do rm -rf "$path"; done
  for entry in "${aside[@]}"; do
    rm -rf "${entry%%=*}"
    mv "${entry#*=}" "${entry%%=*}" && echo "test_package: put ${entry%%=*} back" >&2
  done
  [[ $had_user == 1 ]] || ! getent passwd flexkv >/dev/null || userdel flexkv
  [[ $had_admin_group == 1 ]] || ! getent group flexkv-admin >/dev/null || groupdel flexkv-admin
  [[ $had_group == 1 ]] || ! getent group flexkv >/dev/null || groupdel flexkv
  rm -rf "$TMP"
  [[ $rc -eq 0 ]] || echo "test_package: failed (exit $rc); the host is back as it was" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
for path in /run/flexkvd /dev/shm/flexkvd; do
  [[ -e $path ]] || continue
  moved=$(dirname "$path")/.flexkvd-aside.$$
  mv "$path" "$moved" || fail "cannot move $path aside to $moved (left as it was)"
  aside+=("$path=$moved")
  echo "test_package: moved $path (left by an earlier run of flexkvd) aside to $moved; it is put back at the end" >&2
done

# --- Build the package from the existing build ---------------------------------------------------------------------
# The Debian layout (lib/<multiarch>) comes from a /usr prefix at configure time: reconfigure an older build/ (made
# before the install rules defaulted to /usr); that rebuilds nothing.
prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$BUILD/CMakeCache.txt")
if [[ $prefix != /usr ]]; then
  step "reconfiguring $BUILD with CMAKE_INSTALL_PREFIX=/usr (was $prefix)"
  cmake -DCMAKE_INSTALL_PREFIX=/usr "$BUILD" >/dev/null
fi
cmake --build "$BUILD" --target flexkv_install_inputs >/dev/null
version=$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' "$BUILD/CPackConfig.cmake")
[[ -n $version ]] || fail "no CPACK_PACKAGE_VERSION in $BUILD/CPackConfig.cmake"
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
rm -rf "$BUILD/package"
(cd "$BUILD" && cpack -G DEB >"$TMP/cpack.log" 2>&1) || { cat "$TMP/cpack.log" >&2; fail "cpack failed"; }
deb=$BUILD/package/flexkvd_${version}_${arch}.deb
[[ -f $deb ]] || fail "cpack made $(ls "$BUILD/package") but not $(basename "$deb")"
step "built $(basename "$deb") ($(du -k "$deb" | cut -f1) KiB)"

# --- The package's metadata ------------------------------------------------------------------------------------------
field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Package) == flexkvd && $(field Version) == "$version" && $(field Architecture) == "$arch" ]] ||
  fail "control: Package/Version/Architecture are '$(field Package)/$(field Version)/$(field Architecture)'"
depends=$(field Depends)
for dep in python3 systemd libc6 'libgrpc\+\+' libprotobuf libsystemd0; do  # python3 by hand, the rest from shlibdeps
  grep -Eq "(^|, )$dep[0-9.]*( |,|$)" <<<"$depends" || fail "Depends lacks $dep: $depends"
done
if ldd "$BUILD/flexkvd" | grep libcudart >/dev/null; then build_kind="GPU build"; else build_kind="CPU-only build"; fi
field Description | sed -n 1p | grep "($build_kind" >/dev/null ||
  fail "the description does not say '$build_kind': $(field Description | head -1)"
dpkg-deb --ctrl-tarfile "$deb" | tar -t | grep -x './conffiles' >/dev/null || fail "no conffiles in the control archive"
[[ $(dpkg-deb -I "$deb" conffiles) == /etc/flexkvd/flexkvd.toml ]] || fail "conffiles: $(dpkg-deb -I "$deb" conffiles)"

# --- Install and check the file list ---------------------------------------------------------------------------------
step "dpkg -i $(basename "$deb")"
dpkg -i "$deb" >"$TMP/dpkg.log" 2>&1 || { cat "$TMP/dpkg.log" >&2; fail "dpkg -i failed"; }
dpkg -L flexkvd | sort >"$TMP/files"
files=()
while read -r path; do [[ -d $path && ! -L $path ]] || files+=("$path"); done <"$TMP/files"
lib=/usr/lib/$multiarch
pydir=/usr/lib/python3/dist-packages/flexkvd
expected=(/usr/bin/flexkvd /usr/bin/flexkvctl /usr/bin/flexkv-bench
  "$lib/libflexkv.so.$version" "$lib/libflexkv.so.0" "$lib/libflexkv.so" "$lib/pkgconfig/flexkv.pc"
  "$lib/cmake/flexkv/flexkvConfig.cmake" "$lib/cmake/flexkv/flexkvConfigVersion.cmake"
  /usr/lib/systemd/system/flexkvd.service /usr/lib/systemd/system/flexkvd.socket
  /usr/lib/sysusers.d/flexkvd.conf /usr/lib/tmpfiles.d/flexkvd.conf /etc/flexkvd/flexkvd.toml
  /usr/share/man/man8/flexkvd.8.gz /usr/share/man/man8/flexkvctl.8.gz
  /usr/share/doc/flexkvd/README.md /usr/share/doc/flexkvd/operations.md /usr/share/doc/flexkvd/BUILDINFO
  /usr/share/doc/flexkvd/examples/engine_cmake/CMakeLists.txt /usr/share/doc/flexkvd/examples/engine_cmake/Makefile
  /usr/share/doc/flexkvd/examples/engine_cmake/main.cc)
if [[ -f client/flexkvctl/completion.cc ]]; then expected+=(/usr/share/bash-completion/completions/flexkvctl); fi
for header in client/include/flexkv/*.h common/include/flexkv/*.h; do expected+=("/usr/include/flexkv/${header##*/}"); done
for module in python/flexkvd/*.py python/flexkvd/py.typed; do expected+=("$pydir/${module##*/}"); done
for path in "${expected[@]}"; do
  grep -qxF "$path" "$TMP/files" || fail "the package lacks $path"
done
# Everything in it is one of these (no test programs, object files, build paths, byte code).
allowed="^(/usr/bin/(flexkvd|flexkvctl|flexkv-bench)|$lib/libflexkv\.so(\.[0-9.]+)?|$lib/pkgconfig/flexkv\.pc"
allowed+="|$lib/cmake/flexkv/flexkvConfig(Version)?\.cmake|/usr/include/flexkv/[a-z_]+\.h"
allowed+="|$pydir/([a-z_]+/)*([a-z_]+\.py|py\.typed|_[a-z_]+\.cpython-[0-9]+-$multiarch\.so)"
allowed+="|/usr/lib/systemd/system/flexkvd\.(service|socket)|/usr/lib/(sysusers|tmpfiles)\.d/flexkvd\.conf"
allowed+="|/etc/flexkvd/flexkvd\.toml|/usr/share/man/man8/(flexkvd|flexkvctl)\.8\.gz"
allowed+="|/usr/share/bash-completion/completions/flexkvctl"
allowed+="|/usr/share/doc/flexkvd/([a-z_]+\.(md|png)|README\.md|BUILDINFO|examples/engine_cmake/(CMakeLists\.txt|Makefile|README\.md|main\.cc)))$"
for path in "${files[@]}"; do
  [[ $path =~ $allowed ]] || fail "unexpected file in the package: $path"
done
step "file list: ${#files[@]} files, the ${#expected[@]} expected ones and nothing else"
# The public headers include only the standard library and each other: nothing of gRPC, protobuf, abseil or CUDA.
if grep -h '^[[:space:]]*#[[:space:]]*include' /usr/include/flexkv/*.h | grep -Ev '<[a-z_]+(\.h)?>|"flexkv/[a-z_]+\.h"'; then
  fail "an installed public header includes something beyond the C/C++ standard library and flexkv/ (above)"
fi
# Each compiles on its own from /usr/include alone; flexkv/c.h also as C.
for header in /usr/include/flexkv/*.h; do
  echo "#include <flexkv/${header##*/}>" | g++ -std=c++20 -x c++ -fsyntax-only - ||
    fail "the installed $header does not compile on its own (C++20)"
done
echo '#include <flexkv/c.h>' | gcc -std=c11 -x c -fsyntax-only - || fail "the installed flexkv/c.h does not compile as C11"
for binary in /usr/bin/flexkvd /usr/bin/flexkvctl /usr/bin/flexkv-bench "$lib/libflexkv.so.0"; do
  if readelf -d "$binary" | grep -E 'RPATH|RUNPATH'; then fail "$binary carries a run path (above)"; fi
done
if [[ $build_kind == "GPU build" ]]; then backends="host cuda"; else backends="host"; fi
grep -qx "backends=$backends" /usr/share/doc/flexkvd/BUILDINFO ||
  fail "BUILDINFO does not say backends=$backends: $(cat /usr/share/doc/flexkvd/BUILDINFO)"
completion=/usr/share/bash-completion/completions/flexkvctl
if [[ -f $completion ]]; then
  bash -c "source $completion && complete -p flexkvctl" >/dev/null || fail "$completion does not register a completion"
fi
cmp -s /usr/lib/systemd/system/flexkvd.service systemd/flexkvd.service || fail "the installed unit differs from systemd/"
ldconfig -p | grep -E "libflexkv\.so\.0 .*=> (/usr)?/lib/$multiarch/libflexkv\.so\.0$" >/dev/null || fail "ld.so.cache does not list $lib/libflexkv.so.0"

# --- postinst: user, groups, directories; nothing enabled or started --------------------------------------------------
uid=$(id -u flexkv) || fail "postinst made no user flexkv (systemd-sysusers)"
((uid < 1000)) || fail "user flexkv has uid $uid; expected a system uid"
getent group flexkv-admin >/dev/null || fail "postinst made no group flexkv-admin"
[[ $(stat -c '%U:%G %a' /dev/shm/flexkvd) == "flexkv:flexkv 700" ]] || fail "/dev/shm/flexkvd: $(stat -c '%U:%G %a' /dev/shm/flexkvd)"
[[ $(stat -c '%U:%G %a' /run/flexkvd) == "flexkv:flexkv 750" ]] || fail "/run/flexkvd: $(stat -c '%U:%G %a' /run/flexkvd)"
if ls /etc/systemd/system/*.wants/flexkvd.* 2>/dev/null; then fail "the package enabled a unit (above)"; fi
pgrep -x flexkvd -u flexkv >/dev/null && fail "a flexkvd runs as flexkv right after dpkg -i: the package started it"

# --- Start the installed daemon as the installed unit says ---------------------------------------------------------------
UNIT=/usr/lib/systemd/system/flexkvd.service
# [Service] settings with continuation lines joined; the last assignment wins, as in systemd.
unit_lines() { sed -e ':a' -e '/\\$/{N;s/\\\n//;ba}' "$UNIT" | grep -v '^[[:space:]]*[#;]'; }
unit_value() { unit_lines | sed -n "s/^$1=//p" | tail -1; }
exec_start=$(unit_value ExecStart)
exec_start=${exec_start#[-@:+!]}
read -ra argv <<<"$exec_start"
[[ ${argv[0]} == /usr/bin/flexkvd ]] || fail "ExecStart= runs ${argv[0]}; expected the installed /usr/bin/flexkvd"
arg_after() { local i; for ((i = 1; i + 1 < ${#argv[@]}; i++)); do [[ ${argv[i]} == "$1" ]] && { echo "${argv[i + 1]}"; return; }; done; }
socket=$(arg_after --socket)
pool=$(arg_after --pool-path)
config=$(arg_after --config)
[[ -n $socket && -n $pool && -n $config ]] || fail "ExecStart= lacks --socket, --pool-path or --config: $exec_start"
user=$(unit_value User) group=$(unit_value Group) umask_value=$(unit_value UMask)
[[ $(unit_value Type) == notify ]] || fail "the unit is not Type=notify; this test waits for READY=1"
# The operator's one edit (docs/operations.md): a pool size for this host; the shipped 64GiB would not fit in CI.
sed -i 's/^pool-size = .*/pool-size = "256MiB"/' "$config"
# RuntimeDirectory= and CacheDirectory=, as systemd makes them before starting the service.
make_dir() {  # <path> <mode>
  install -d -m "${2:-0755}" -o "$user" -g "$group" "$1"
}
for name in $(unit_value RuntimeDirectory); do make_dir "/run/$name" "$(unit_value RuntimeDirectoryMode)"; done
for name in $(unit_value CacheDirectory); do make_dir "/var/cache/$name" "$(unit_value CacheDirectoryMode)"; done
environment=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
while read -r assignment; do
  assignment=${assignment//%C//var/cache}
  assignment=${assignment//%t//run}
  [[ -n $assignment ]] && environment+=("$assignment")
done < <(unit_lines | sed -n 's/^Environment=//p' | tr ' ' '\n')
# Type=notify: the daemon's READY=1 arrives on NOTIFY_SOCKET (a datagram socket the flexkv user may write to).
notify_socket=$TMP/notify.sock
/usr/bin/python3 - "$notify_socket" "$user" >"$TMP/notify.log" 2>&1 <<'EOF' &
import os, pwd, socket, sys
path, user = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(path)
os.chown(path, pwd.getpwnam(user).pw_uid, -1)
s.settimeout(120)
while True:
    message = s.recv(4096).decode()
    print(message.replace("\n", " "), flush=True)
    if "READY=1" in message.split("\n"):
        break
EOF
notify_pid=$!
for _ in $(seq 100); do [[ -S $notify_socket ]] && break; sleep 0.05; done
# LimitMEMLOCK= and LimitNOFILE=, as far as this host lets root raise them (a container without CAP_SYS_RESOURCE
# keeps its hard limits: then the soft limit goes up to the hard one, and the log says so).
limits=()
limit() {  # <prlimit option> <unit value>
  local option=$1 value=${2/infinity/unlimited}
  [[ -n $value ]] || return 0
  if prlimit "--$option=$value" -- true 2>/dev/null; then
    limits+=("--$option=$value")
  else
    local hard
    hard=$(prlimit --noheadings --output HARD "--$option" --pid $$)
    step "this host does not allow $option=$value (no CAP_SYS_RESOURCE?): using its hard limit $hard"
    limits+=("--$option=$hard")
  fi
}
limit memlock "$(unit_value LimitMEMLOCK)"
limit nofile "$(unit_value LimitNOFILE)"
no_new_privs=()
[[ $(unit_value NoNewPrivileges) == yes ]] && no_new_privs=(--no-new-privs)
step "starting as $user:$group, umask ${umask_value:-0022}: ${argv[*]}"
(
  umask "${umask_value:-0022}"
  cd /
  exec prlimit "${limits[@]}" -- env -i "${environment[@]}" NOTIFY_SOCKET="$notify_socket" \
    setpriv --reuid="$user" --regid="$group" --init-groups --bounding-set=-all --inh-caps=-all "${no_new_privs[@]}" \
    -- "${argv[@]}"
) >"$TMP/flexkvd.log" 2>&1 &
daemon_pid=$!
while kill -0 "$notify_pid" 2>/dev/null; do
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$TMP/flexkvd.log" >&2; fail "flexkvd exited before READY=1 (log above)"; }
  sleep 0.1
done
if ! wait "$notify_pid"; then
  cat "$TMP/flexkvd.log" "$TMP/notify.log" >&2
  fail "no READY=1 from the installed flexkvd within 120 s (its log is above)"
fi
kill -0 "$daemon_pid" 2>/dev/null || { cat "$TMP/flexkvd.log" >&2; fail "flexkvd exited after READY=1"; }
[[ $(ps -o user= -p "$daemon_pid") == "$user" ]] || fail "flexkvd runs as $(ps -o user= -p "$daemon_pid"), not $user"
[[ $(readlink "/proc/$daemon_pid/exe") == /usr/bin/flexkvd ]] || fail "pid $daemon_pid is not /usr/bin/flexkvd"
[[ $(stat -c '%G %a' "$socket") == "flexkv 660" ]] || fail "socket $socket: $(stat -c '%G %a' "$socket" 2>&1)"
step "ready: $(cat "$TMP/notify.log" | tail -1)"

# --- The installed clients reach it ------------------------------------------------------------------------------------
status=$(/usr/bin/flexkvctl --socket "$socket" status) || fail "installed flexkvctl status failed: $status"
grep -q serving <<<"$status" || fail "flexkvctl status does not say serving: $status"
grep -q "$version" <<<"$status" || fail "flexkvctl status does not name version $version: $status"
step "flexkvctl: $(head -1 <<<"$status")"

namespace=package-test
cd "$TMP"  # nothing of the source tree on sys.path; no PYTHONPATH, no FLEXKV_LIBRARY
# A compiled extension in the package (python/flexkvd/_fast.c, when the build had python3-dev) must be the one in use.
extension=$(grep -E "^$pydir/_[a-z_]+\.cpython-.*\.so$" "$TMP/files" | head -1 || true)
env -i PATH=/usr/bin:/bin /usr/bin/python3 - "$socket" "$namespace" "$pydir" "$lib" "$extension" <<'EOF' ||
import sys
import flexkvd
socket_path, namespace, pydir, libdir, extension = sys.argv[1:]
assert flexkvd.__file__.startswith(pydir + "/"), f"flexkvd imported from {flexkvd.__file__}, not {pydir}"
if extension:
    in_use = getattr(flexkvd, "fast_path", None)
    assert in_use == extension, f"the package ships {extension} but flexkvd.fast_path is {in_use!r}"
maps = open("/proc/self/maps").read()
assert f"{libdir}/libflexkv.so.0" in maps, "the installed libflexkv.so.0 is not the one loaded"
geometry = flexkvd.Geometry(tokens_per_block=16, num_layers=2, kv_planes=2, kv_heads_per_rank=1, head_dim=64)
with flexkvd.connect(socket_path) as client:
    client.attach("package-test-python", namespace, geometry)
    kv = client.create_host_kv(flexkvd.Layout.BLOCK_FIRST, num_blocks=4)
    kv[:] = bytes(i % 251 for i in range(len(kv)))
    keys = flexkvd.block_keys(namespace, range(2000, 2064), tokens_per_block=16)
    stored = client.store(keys, range(4)).wait(timeout=10.0)
    hit = client.match(keys).wait(timeout=10.0)
    assert hit.matched_blocks == 4, f"matched {hit.matched_blocks} of 4 blocks just stored"
    print(f"python: stored {stored.done_blocks} blocks, matched {hit.matched_blocks} of 4 ({flexkvd.__file__})")
    del kv
EOF
  fail "the installed Python package could not attach, store and match (above)"
cd "$ROOT"
# The first Attach made the cache domain's pool file, where the unit says, private to the daemon's user.
[[ $(stat -c '%U %a' "$pool") == "$user 600" ]] || fail "pool $pool: $(stat -c '%U %a' "$pool" 2>&1)"

# The example engine project, copied from the installed docs, built against the installed files both ways.
example=$TMP/engine_cmake
cp -r /usr/share/doc/flexkvd/examples/engine_cmake "$example"
clean_env=(env -u CMAKE_PREFIX_PATH -u PKG_CONFIG_PATH -u CPATH -u LIBRARY_PATH -u LD_LIBRARY_PATH -u FLEXKV_LIBRARY)
"${clean_env[@]}" cmake -S "$example" -B "$example/build" >"$TMP/example-cmake.log" 2>&1 &&
  "${clean_env[@]}" cmake --build "$example/build" >>"$TMP/example-cmake.log" 2>&1 ||
  { cat "$TMP/example-cmake.log" >&2; fail "the example does not build with find_package(flexkv CONFIG)"; }
"${clean_env[@]}" make -C "$example" >"$TMP/example-make.log" 2>&1 ||
  { cat "$TMP/example-make.log" >&2; fail "the example does not build with pkg-config"; }
for program in "$example/build/flexkv_engine_example" "$example/flexkv_engine_example"; do
  ldd "$program" | grep -E "libflexkv\.so\.0 => (/usr)?/lib/$multiarch/libflexkv\.so\.0 " >/dev/null || fail "$program does not load $lib/libflexkv.so.0"
  out=$("${clean_env[@]}" "$program" --socket "$socket" --namespace "$namespace" 2>&1) || fail "$program: $out"
  step "${program#"$TMP"/}: $out"
done

# --- Reinstall over the running daemon (what an upgrade does): it keeps running, and the operator's config stays --------
dpkg -i "$deb" </dev/null >"$TMP/dpkg.log" 2>&1 || { cat "$TMP/dpkg.log" >&2; fail "dpkg -i over the installed package failed"; }
kill -0 "$daemon_pid" 2>/dev/null || fail "reinstalling the package stopped the running flexkvd"
grep -qx 'pool-size = "256MiB"' "$config" || fail "reinstalling the package replaced the operator's $config"
out=$("${clean_env[@]}" "$example/flexkv_engine_example" --socket "$socket" --namespace "$namespace" 2>&1) ||
  fail "after the reinstall: $out"
grep -F '(0 new)' <<<"$out" >/dev/null || fail "after the reinstall the blocks were not cached any more: $out"
step "reinstalled over the running daemon: same pid, config kept, blocks still cached"

# --- Stop it as systemd would (SIGTERM: drain, exit 0) -------------------------------------------------------------------
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=""
[[ $rc -eq 0 ]] || { cat "$TMP/flexkvd.log" >&2; fail "flexkvd exited $rc on SIGTERM; expected 0 (its log is above)"; }
step "stopped (SIGTERM, exit 0)"

# --- Remove: the programs go; the config, the pool (a cache that survives) and the user stay ----------------------------
dpkg --remove flexkvd >"$TMP/dpkg.log" 2>&1 || { cat "$TMP/dpkg.log" >&2; fail "dpkg --remove failed"; }
[[ $(dpkg-query -W -f='${Status}' flexkvd) == "deinstall ok config-files" ]] ||
  fail "after dpkg --remove the status is '$(dpkg-query -W -f='${Status}' flexkvd)'; expected config-files"
for path in /usr/bin/flexkvd "$lib/libflexkv.so.0" "$pydir"; do [[ ! -e $path ]] || fail "$path is left after remove"; done
for path in "$config" "$pool"; do [[ -e $path ]] || fail "$path was deleted by dpkg --remove; it must stay until purge"; done
step "removed: programs gone; $config, $pool and user $user kept"

# --- Purge: nothing left but what policy keeps --------------------------------------------------------------------------
dpkg --purge flexkvd >"$TMP/dpkg.log" 2>&1 || { cat "$TMP/dpkg.log" >&2; fail "dpkg --purge failed"; }
[[ $(dpkg-query -W -f='${Status}' flexkvd 2>/dev/null || echo "unknown ok not-installed") == "unknown ok not-installed" ]] ||
  fail "flexkvd is still known to dpkg after purge: $(dpkg-query -W -f='${Status}' flexkvd)"
left=()
while read -r path; do [[ -e $path || -L $path ]] && [[ ! -d $path || $path == */flexkv* ]] && left+=("$path"); done <"$TMP/files"
for path in /dev/shm/flexkvd /run/flexkvd /var/cache/flexkvd /etc/flexkvd "$pydir"; do
  [[ -e $path ]] && left+=("$path")
done
[[ ${#left[@]} -eq 0 ]] || fail "left behind after purge: ${left[*]}"
ldconfig -p | grep libflexkv >/dev/null && fail "ld.so.cache still lists libflexkv after purge"
# Policy keeps the system user and its groups (files elsewhere may belong to them; uids are not reused).
kept=()
getent passwd flexkv >/dev/null && kept+=("user flexkv")
getent group flexkv >/dev/null && kept+=("group flexkv")
getent group flexkv-admin >/dev/null && kept+=("group flexkv-admin")
[[ "${kept[*]}" == "user flexkv group flexkv group flexkv-admin" ]] ||
  fail "after purge the expected kept set is user flexkv and groups flexkv, flexkv-admin; found: ${kept[*]:-nothing}"
step "purged: nothing left of the package; kept, as policy says: ${kept[*]} (deleted now by this test if it made them)"
echo "PASS scripts/test_package.sh ($(basename "$deb"), $build_kind)"
