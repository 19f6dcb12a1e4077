#!/usr/bin/env bash
# Installs the real servers the conformance harness starts (Debian 12 "bookworm" packages):
#
#   redis-server redis-tools     Redis 7.0   (redis-server on PATH)
#   etcd-server etcd-client      etcd 3.4    (etcd, etcdctl on PATH)
#   libzookeeper-java            ZooKeeper 3.8 jars in /usr/share/java (zookeeper.jar + deps,
#                                including libslf4j-java's slf4j-simple.jar used for logging)
#   default-jre-headless         Java 17 to run ZooKeeper
#   protobuf-compiler libprotobuf-dev   protoc for the etcd gRPC client's build script
#   postgresql                   PostgreSQL 15 server (for the PostgreSQL backend work)
#   iproute2                     `ip netns` and veth pairs for the etcd cluster's members (each in
#                                its own network namespace, cut from its peers by blackhole routes)
#   python3                      a many-threaded process the test kit's pause/resume tests stop
#   openssl                      the `openssl` command the Redis TLS tests make certificates with
#
# The Redis Sentinels of the replicated-Redis cluster run as `redis-server <conf> --sentinel` (the
# binary Debian's redis-sentinel package links to), so that package is not needed.
#
# Debian's `zookeeper` package is deliberately not installed: it only adds an init script, a
# system user and a dependency on the full (GUI) `default-jre`; the harness runs
# ZooKeeperServerMain straight from libzookeeper-java's jars.
#
# Contract:
#   - idempotent: installs only what is missing; runs `apt-get update` once, and only then;
#   - needs root (or sudo) only when something is missing: with everything installed it runs as
#     any user and changes nothing;
#   - starts no service: a policy-rc.d answering 101 is in place during the install (the
#     previous policy-rc.d, if any, is restored afterwards), so neither sysvinit scripts nor
#     systemd units of the new packages are started; the harness starts its own servers on
#     free ports with temporary data directories;
#   - prints what it installed and the versions found.
set -euo pipefail

PACKAGES=(
  redis-server
  redis-tools
  etcd-server
  etcd-client
  libzookeeper-java
  default-jre-headless
  protobuf-compiler
  libprotobuf-dev
  postgresql
  iproute2
  python3
  openssl
)

if [[ ! -r /etc/debian_version ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup.sh: this script installs Debian packages; not a Debian system" >&2
  exit 1
fi

installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true)" == "install ok installed" ]]
}

missing=()
for pkg in "${PACKAGES[@]}"; do
  installed "$pkg" || missing+=("$pkg")
done

# Root only to install: with nothing missing, any user goes on without sudo (or its prompt).
if ((${#missing[@]} > 0)) && [[ "$(id -u)" -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    exec sudo --preserve-env=DEBIAN_FRONTEND "$0" "$@"
  fi
  echo "setup.sh: must run as root to install ${missing[*]} (no sudo found)" >&2
  exit 1
fi

if ((${#missing[@]} == 0)); then
  echo "setup.sh: all packages already installed: ${PACKAGES[*]}"
else
  echo "setup.sh: installing: ${missing[*]}"

  # Keep services from starting during the install (exit 101 = "action forbidden").
  policy=/usr/sbin/policy-rc.d
  backup=""
  marker="# written by fenced-leases scripts/setup.sh during apt-get install"
  if [[ -e "$policy" ]] && ! grep -qxF "$marker" "$policy"; then
    backup="$(mktemp)"
    cp -p "$policy" "$backup"
  fi
  restore_policy() {
    if [[ -n "$backup" ]]; then
      mv -f "$backup" "$policy"
    else
      rm -f "$policy"
    fi
  }
  trap restore_policy EXIT
  # (Ours, left by an earlier run that was killed mid-install, is not saved as the admin's.)
  printf '#!/bin/sh\n%s\nexit 101\n' "$marker" >"$policy"
  chmod 0755 "$policy"

  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"

  restore_policy
  trap - EXIT
  echo "setup.sh: installed: ${missing[*]}"
fi

# Warn (do not kill: those processes are not ours) if a server daemon is running anyway, e.g.
# one a system administrator started earlier. The harness does not need the standard ports.
running=()
for comm in /proc/[0-9]*/comm; do
  name="$(cat "$comm" 2>/dev/null || true)"
  case "$name" in
    redis-server | etcd | postgres) running+=("$name(pid ${comm//[^0-9]/})") ;;
  esac
done
if ((${#running[@]} > 0)); then
  echo "setup.sh: note: server processes not started by this script are running: ${running[*]}" >&2
fi

echo "setup.sh: versions:"
# Informational only: read each version into a variable first, so that `head` closing a pipe
# early (SIGPIPE under pipefail) can never fail the script.
version() { local out; out="$("$@" 2>&1 || true)"; printf '  %s\n' "${out%%$'\n'*}"; }
version redis-server --version
version etcd --version
version java -version
echo "  ZooKeeper jar: $(readlink -f /usr/share/java/zookeeper.jar || true)"
version protoc --version
pg_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)"
if [[ -n "$pg_bin" ]]; then
  version "$pg_bin/postgres" --version
fi
