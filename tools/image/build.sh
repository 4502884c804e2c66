#!/usr/bin/env bash
# make image: the danube-ingest OCI image, built here from Debian's packages and the project's
# own wheel (no registry, no Docker engine: debootstrap + podman import). Reproducible on one
# Debian base: the rootfs tar has sorted names, the commit's time as every mtime, numeric owners
# (root's, and the user danube's /data), no bytecode, and pip installs the versions of the
# project's virtualenv (constraints). The image is tagged localhost/danube-ingest:<digest of that
# tar> and :latest; a tar already imported is not imported again, and older digests are removed
# from podman's store (DANUBE_INGEST_IMAGE_KEEP=N keeps the N newest; an image a container still
# uses stays). Prints the tag last. Needs root (debootstrap, chroot), podman and runc.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${DANUBE_INGEST_IMAGE_DIR:-$ROOT/.deps/image}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,openjdk-17-jre-headless,tini
EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 0)
export SOURCE_DATE_EPOCH=$EPOCH
mkdir -p "$OUT"

# 1. The Debian base, once per suite and package list (kept as a tar).
base_key=$(printf '%s %s' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-16)
base_tar=$OUT/base-$base_key.tar
if [ ! -s "$base_tar" ]; then
  rm -rf "$OUT/base" && mkdir -p "$OUT/base"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$OUT/base" "$MIRROR" >"$OUT/debootstrap.log"
  rm -rf "$OUT/base/var/cache/apt/archives/"*.deb "$OUT/base/var/lib/apt/lists/"*
  tar -C "$OUT/base" -cf "$base_tar.part" . && mv "$base_tar.part" "$base_tar"
  rm -rf "$OUT/base"
fi

# 2. The project's wheel and the versions its virtualenv holds.
rm -rf "$OUT/wheel" && mkdir -p "$OUT/wheel"
.venv/bin/pip wheel --quiet --no-deps -w "$OUT/wheel" . >/dev/null
.venv/bin/pip freeze --exclude-editable | grep -v '^danube-ingest' >"$OUT/wheel/constraints.txt"

# The image's inputs: the base, the wheel, the versions, the jars and this script. An image tar
# made from the same inputs is reused (DANUBE_INGEST_IMAGE_REBUILD=1 builds it again).
inputs=$( { echo "$base_key"; sha256sum "$OUT"/wheel/*; find .deps/kafka .deps/iceberg -type f \
  -name '*.jar' -printf '%p %s\n' | sort; sha256sum "$ROOT/tools/image/build.sh"; } | sha256sum | cut -c1-16)
image_tar=$OUT/image-$inputs.tar
if [ -s "$image_tar" ] && [ "${DANUBE_INGEST_IMAGE_REBUILD:-0}" != 1 ]; then
  built=1
else
  built=0
fi

if [ "$built" = 0 ]; then
  # 3. The rootfs: the base, a virtualenv at /opt/danube-ingest with the wheel, the Maven jars,
  #    a user danube (uid 10001) owning /data.
  rootfs=$OUT/rootfs
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  tar -C "$rootfs" -xf "$base_tar"
  cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
  mkdir -p "$rootfs/tmp/wheel" "$rootfs/root/.cache/pip" "$HOME/.cache/pip"
  cp "$OUT"/wheel/* "$rootfs/tmp/wheel/"
  mount --bind "$HOME/.cache/pip" "$rootfs/root/.cache/pip"  # (the wheels make setup fetched)
  # pip in the rootfs trusts what the host trusts (a proxy's CA) and sees its local wheels.
  cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$rootfs/tmp/host-ca.crt"
  links=${PIP_FIND_LINKS:-}
  if [ -n "$links" ] && [ -d "$links" ]; then
    mkdir -p "$rootfs$links" && mount --bind "$links" "$rootfs$links"
  else
    links=
  fi
  unmount() {
    umount "$rootfs/root/.cache/pip" 2>/dev/null || true
    [ -z "$links" ] || umount "$rootfs$links" 2>/dev/null || true
  }
  trap unmount EXIT
  chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    PIP_CERT=/tmp/host-ca.crt PIP_FIND_LINKS="$links" PIP_DEFAULT_TIMEOUT=180 \
    PYTHONDONTWRITEBYTECODE=1 SOURCE_DATE_EPOCH="$EPOCH" /bin/sh -euc '
      python3 -m venv /opt/danube-ingest
      /opt/danube-ingest/bin/pip install --quiet --no-compile --disable-pip-version-check \
        -c /tmp/wheel/constraints.txt /tmp/wheel/danube_ingest-*.whl
      echo "danube:x:10001:10001:danube-ingest:/data:/usr/sbin/nologin" >>/etc/passwd
      echo "danube:x:10001:" >>/etc/group
      mkdir -p /data && chown 10001:10001 /data
    '
  unmount
  trap - EXIT
  [ -z "$links" ] || rmdir -p "$rootfs$links" 2>/dev/null || true
  mkdir -p "$rootfs/opt/danube-ingest/jars"
  cp -r .deps/kafka "$rootfs/opt/danube-ingest/jars/kafka"
  cp -r .deps/iceberg "$rootfs/opt/danube-ingest/jars/iceberg"
  rm -rf "$rootfs/tmp/wheel" "$rootfs/tmp/host-ca.crt" "$rootfs/root/.cache" "$rootfs/etc/resolv.conf" "$rootfs/var/log/"*
  : >"$rootfs/etc/resolv.conf"
  rm -f "$rootfs/var/cache/ldconfig/aux-cache"  # (inode numbers and times: a cache)
  find "$rootfs" -name '__pycache__' -prune -exec rm -rf {} +
  find "$rootfs/opt/danube-ingest" -name 'direct_url.json' -delete  # (names the build dir)

  # 4. One layer: a deterministic tar, imported once per digest.
  tar -C "$rootfs" --sort=name --mtime="@$EPOCH" --numeric-owner \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime -cf "$image_tar.part" .
  rm -f "$OUT"/image-*.tar
  mv "$image_tar.part" "$image_tar"
  rm -rf "$rootfs"
fi
digest=$(sha256sum "$image_tar" | cut -c1-16)
tag=localhost/danube-ingest:$digest
PODMAN_OPTS=$(.venv/bin/python -c 'from danube_ingest.containers import PODMAN_OPTIONS as o; print(*o)')
conf=$OUT/containers.conf
printf '[containers]\ndefault_ulimits = []\n' >"$conf"
if ! CONTAINERS_CONF=$conf podman $PODMAN_OPTS image exists "$tag"; then
  CONTAINERS_CONF=$conf podman $PODMAN_OPTS import --quiet \
    --change 'USER 10001' --change 'WORKDIR /data' --change 'VOLUME /data' \
    --change 'ENV DANUBE_INGEST_DATA_DIR=/data' \
    --change 'ENV DANUBE_INGEST_KAFKA_JARS=/opt/danube-ingest/jars/kafka' \
    --change 'ENV DANUBE_INGEST_ICEBERG_JARS=/opt/danube-ingest/jars/iceberg' \
    --change 'ENV PATH=/opt/danube-ingest/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENTRYPOINT ["/usr/bin/tini", "--", "/opt/danube-ingest/bin/danube-ingest"]' \
    --change 'CMD ["--help"]' \
    "$image_tar" "$tag" >/dev/null
fi
CONTAINERS_CONF=$conf podman $PODMAN_OPTS tag "$tag" localhost/danube-ingest:latest

# 5. Older digests leave podman's store (each is a 1.6 GB layer of its own): the newest KEEP stay.
keep=${DANUBE_INGEST_IMAGE_KEEP:-1}
CONTAINERS_CONF=$conf podman $PODMAN_OPTS images --sort created --format '{{.Repository}}:{{.Tag}}' \
  localhost/danube-ingest | { grep -v -e ':latest$' -e ":$digest\$" || true; } | tail -n +"$keep" |
  while read -r old; do
    CONTAINERS_CONF=$conf podman $PODMAN_OPTS rmi "$old" >/dev/null 2>&1 \
      || echo "kept $old (a container still uses it)" >&2
  done
echo "$tag"
