#!/bin/sh
# Entry point of peerd's image (see Dockerfile): the wiring a swarm of containers needs before `peerd start`.
#
# Announced address. A peer listens on all interfaces of its container; others must be told an address they
#   can dial, not the 0.0.0.0 it listens on. Unless PEERD_SWARM__ANNOUNCE_MADDRS is set (e.g.
#   /dns/bootstrap/tcp/31337 for a peer with a fixed DNS name), this announces the container's own address on
#   its network, /ip4/<container ip>/tcp/$ANNOUNCE_PORT (default 31337), so replicas of a scaled service
#   (`--scale trainer=5`) each announce their own. ANNOUNCE_HOST overrides the detected address.
# Identity made at first start. With PEERD_SWARM__IDENTITY_PATH set (peerd reads it as swarm.identity_path) and
#   no file there yet, a new key is made with `peerd keygen`: every deployment gets its own secret key, none
#   is ever in the repository or the image, and a volume at that path keeps the peer id across restarts.
# Sharing the bootstrap address. SHARE_ADDRESS=<file>: once the identity is known, write the full multiaddr
#   others dial (the first announced address + /p2p/<peer id>) to <file>, e.g. on a volume the other services
#   mount. BOOTSTRAP_FROM=<file>: wait for that file (at most $BOOTSTRAP_WAIT s, default 300) and bootstrap
#   from the address in it, unless PEERD_SWARM__INITIAL_PEERS is set. So `docker compose up` needs no .env
#   and no step before it.
set -eu
log() { echo "peerd-entrypoint: $*" >&2; }

if [ -z "${PEERD_SWARM__ANNOUNCE_MADDRS:-}" ]; then
  host=${ANNOUNCE_HOST:-$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')}
  case "$host" in
    *[!0-9.]*) proto=dns ;;
    *) proto=ip4 ;;
  esac
  PEERD_SWARM__ANNOUNCE_MADDRS="[\"/$proto/$host/tcp/${ANNOUNCE_PORT:-31337}\"]"
  export PEERD_SWARM__ANNOUNCE_MADDRS
fi

key=${PEERD_SWARM__IDENTITY_PATH:-}
if [ -n "$key" ] && [ ! -e "$key" ]; then
  mkdir -p "$(dirname "$key")"
  log "no identity at $key: making one (peer id $(peerd keygen "$key"))"
fi

if [ -n "${SHARE_ADDRESS:-}" ]; then
  [ -n "$key" ] || { log "SHARE_ADDRESS needs a fixed identity: set PEERD_SWARM__IDENTITY_PATH"; exit 2; }
  address=$(python3 - "$key" <<'EOF'
import json, os, sys
from pathlib import Path
from peerd.swarm.identity import load_peer_id
announced = json.loads(os.environ["PEERD_SWARM__ANNOUNCE_MADDRS"])[0]
print(f"{announced}/p2p/{load_peer_id(Path(sys.argv[1]))}")
EOF
  )
  mkdir -p "$(dirname "$SHARE_ADDRESS")"
  # a reader never sees half a line: write beside it, then rename
  echo "$address" >"$SHARE_ADDRESS.partial"
  mv "$SHARE_ADDRESS.partial" "$SHARE_ADDRESS"
  log "bootstrap address $address (in $SHARE_ADDRESS)"
fi

if [ -n "${BOOTSTRAP_FROM:-}" ] && [ -z "${PEERD_SWARM__INITIAL_PEERS:-}" ]; then
  waited=0
  until [ -s "$BOOTSTRAP_FROM" ]; do
    if [ "$waited" -ge "${BOOTSTRAP_WAIT:-300}" ]; then
      log "no bootstrap address in $BOOTSTRAP_FROM after ${waited} s: is the bootstrap service running?"
      exit 2
    fi
    sleep 1  # a file on a shared volume: no event to wait on across containers
    waited=$((waited + 1))
  done
  PEERD_SWARM__INITIAL_PEERS="[\"$(cat "$BOOTSTRAP_FROM")\"]"
  export PEERD_SWARM__INITIAL_PEERS
fi
exec "$@"
