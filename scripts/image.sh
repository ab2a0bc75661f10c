#!/usr/bin/env bash
# Builds the CPU image from the Dockerfile with Debian's podman and tests it:
# the server in a container passes the client's checked demo, its health
# check (GET /readyz) passes, and it drains and exits 0 on SIGTERM; and
# that the image carries no shared library outside Debian's packages, no
# LD_LIBRARY_PATH, and its OCI labels.
#   scripts/image.sh [--tag mlaverify:cpu] [--keep]
# No registry is reachable from the build machines, so the Debian 12 base
# image is made here first (debootstrap from Debian's archive, imported as
# docker.io/library/debian:12) unless one exists. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=mlaverify:cpu
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    *) echo "image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# runc rather than crun (crun refuses cgroups in hybrid mode), and resource
# limits within the host's hard limits: root here may lack CAP_SYS_RESOURCE,
# and podman's defaults (1M open files) would need it.
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
pod=(podman --runtime runc)
limits=(--ulimit "nofile=$nofile:$nofile" --ulimit nproc=16384:16384)

base=docker.io/library/debian:12
if ! podman image exists "$base"; then
  rootfs=$(mktemp -d /tmp/mlaverify-debian12.XXXX)
  echo "== making $base with debootstrap (minbase bookworm) in $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian > "$rootfs.log" 2>&1 ||
    { tail -20 "$rootfs.log"; exit 1; }
  # What debootstrap downloaded is not part of the image.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$base"
  rm -rf "$rootfs" "$rootfs.log"
fi

version=$(sed -n 's/^project(mlaverify VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
echo "== podman build -t $tag (version $version, revision $revision)"
# Host networking: the build stage fetches Debian packages. Docker format:
# the OCI format has no HEALTHCHECK.
"${pod[@]}" build --format docker --network host "${limits[@]}" \
  --build-arg VERSION="$version" --build-arg REVISION="$revision" -t "$tag" .
podman image ls "$tag"
echo "image size: $(podman image inspect --format '{{.Size}}' "$tag") bytes"

echo "== the runtime stage"
# Every shared library in the image belongs to a Debian package (dpkg's file
# lists; /lib, /bin and /sbin are /usr's since the usr merge), none was copied
# in, and no LD_LIBRARY_PATH points elsewhere. (The script runs in the
# container: its variables are the container's.)
# As root, so that find reads every directory.
echo "user: $(podman image inspect --format '{{.Config.User}}' "$tag")"
# shellcheck disable=SC2016
"${pod[@]}" run --rm "${limits[@]}" --user 0 --entrypoint /bin/bash "$tag" -c '
  set -euo pipefail
  ls -l /opt/mlaverify/bin
  echo "runtime packages: $(tr "\n" " " < /opt/mlaverify/runtime-packages)"
  echo "installed packages: $(dpkg-query -W | wc -l); $(du -sh /var/cache | cut -f1) in /var/cache"
  if [ -n "${LD_LIBRARY_PATH+set}" ]; then echo "LD_LIBRARY_PATH is set: $LD_LIBRARY_PATH"; exit 1; fi
  libs=$(find / -xdev \( -name "*.so" -o -name "*.so.[0-9]*" \) \( -type f -o -type l \) | sort)
  unowned=$(comm -23 <(echo "$libs") \
    <(cat /var/lib/dpkg/info/*.list | sed -E "s#^/(lib|bin|sbin)#/usr/\1#" | sort -u))
  echo "shared libraries: $(echo "$libs" | wc -l), owned by no package: $(echo -n "$unowned" | grep -c . || true)"
  [ -z "$unowned" ] || { echo "$unowned"; exit 1; }
  ! command -v curl' || { echo "image.sh: the runtime stage carries more than its packages" >&2; exit 1; }
env=$(podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$tag")
if grep -q '^LD_LIBRARY_PATH=' <<< "$env"; then
  echo "image.sh: the image sets LD_LIBRARY_PATH" >&2; exit 1
fi
echo "== OCI labels"
label() { podman image inspect --format "{{index .Labels \"org.opencontainers.image.$1\"}}" "$tag"; }
for key in title description source version revision; do
  value=$(label "$key")
  echo "org.opencontainers.image.$key=$value"
  case $value in ""|"<no value>") echo "image.sh: label $key missing" >&2; exit 1 ;; esac
done
if [ "$(label version)" != "$version" ] || [ "$(label revision)" != "$revision" ]; then
  echo "image.sh: the version or revision label differs from the build's" >&2; exit 1
fi
# The binaries report the same commit (the first 12 characters) as the label.
for bin in mlaverify-server mlaverify-client; do
  line=$("${pod[@]}" run --rm "${limits[@]}" --entrypoint "$bin" "$tag" --version)
  echo "$line"
  case $line in
    *"$version (git ${revision:0:12};"*) ;;
    *) echo "image.sh: $bin --version does not name version $version and commit ${revision:0:12}" >&2
       exit 1 ;;
  esac
done

name=mlaverify-image-test-$$
# Host networking (nothing else is reachable here): a free gRPC port, and
# the image's own admin port 9090, which its HEALTHCHECK probes.
port=$((20000 + RANDOM % 20000))
admin=9090
if (exec 3<> /dev/tcp/127.0.0.1/$admin) 2>/dev/null; then
  echo "image.sh: port $admin is in use on this host; the container's health check needs it" >&2
  exit 1
fi
cleanup() { podman rm -f "$name" > /dev/null 2>&1 || true; }
[ "$keep" -eq 1 ] || trap cleanup EXIT
"${pod[@]}" run -d --name "$name" --network host "${limits[@]}" "$tag" \
  --listen "127.0.0.1:$port" \
  --admin-host 127.0.0.1 --admin-port "$admin" --backend cpu --layers 61 --heads 8 \
  --page-size 64 --pool-bytes 512MiB --drain-grace-s 1 > /dev/null
client=("${pod[@]}" exec "$name" mlaverify-client --target "127.0.0.1:$port")
for _ in $(seq 1 100); do "${client[@]}" health > /dev/null 2>&1 && break; sleep 0.2; done
"${client[@]}" health
echo "== demo against the containerised server"
"${client[@]}" demo --sequences 2 --prompt-len 300 --steps 4 --drafts 8 | tail -3
echo "== the image's health check"
"${pod[@]}" healthcheck run "$name"
echo "healthcheck: healthy"
echo "== SIGTERM"
"${pod[@]}" stop --time 30 "$name" > /dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$name")
podman logs "$name" 2>&1 | tail -2
[ "$code" -eq 0 ] || { echo "image.sh: the server exited $code after SIGTERM"; exit 1; }
echo "image.sh: PASS ($tag)"
