#!/bin/sh
# Entry point of peerd's image (see Dockerfile). A peer listens on all interfaces of its container; others must
# be told an address they can dial, not the 0.0.0.0 it listens on. Unless PEERD_SWARM__ANNOUNCE_MADDRS is set
# (e.g. /dns/bootstrap/tcp/31337 for a peer with a fixed DNS name), this announces the container's own address
# on its network, /ip4/<container ip>/tcp/$ANNOUNCE_PORT (default 31337), so replicas of a scaled service
# (`--scale trainer=5`) each announce their own. ANNOUNCE_HOST overrides the detected address.
set -eu
if [ -z "${PEERD_SWARM__ANNOUNCE_MADDRS:-}" ]; then
  host=${ANNOUNCE_HOST:-$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')}
  case "$host" in
    *[!0-9.]*) proto=dns ;;
    *) proto=ip4 ;;
  esac
  PEERD_SWARM__ANNOUNCE_MADDRS="[\"/$proto/$host/tcp/${ANNOUNCE_PORT:-31337}\"]"
  export PEERD_SWARM__ANNOUNCE_MADDRS
fi
exec "$@"
