#!/usr/bin/env bash
# A real SuperLink on localhost with TLS and SuperNode authentication: a SuperNode whose key is registered comes
# online, a SuperNode whose key is not is refused. Called by scripts/ci_flower.sh with Flower's commands on PATH;
# the commands are those of docs/flower.md ("Deploying for real"). Everything lives in a fresh folder, and only the
# processes started here are stopped (by their ids).
set -euo pipefail

for command in flower-superlink flower-supernode flower-superexec flwr openssl ssh-keygen; do
  command -v "$command" >/dev/null || { echo "[auth] $command is not on PATH"; exit 1; }
done
WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 20); do
    alive=""
    for pid in "${PIDS[@]}"; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done
    [ -z "$alive" ] && break
    sleep 0.5
  done
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
cd "$WORK"
mkdir certs keys home
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# certificates: a private CA and the SuperLink's certificate for localhost
openssl genrsa -out certs/ca.key 4096 2>/dev/null
openssl req -x509 -new -key certs/ca.key -sha256 -days 2 -subj "/CN=fedhet-test-ca" -out certs/ca.crt
openssl genrsa -out certs/server.key 4096 2>/dev/null
openssl req -new -key certs/server.key -subj "/CN=superlink" -out certs/server.csr
printf "subjectAltName=DNS:localhost,IP:127.0.0.1\n" > certs/san.ext
openssl x509 -req -in certs/server.csr -CA certs/ca.crt -CAkey certs/ca.key -CAcreateserial -days 2 -sha256 \
  -extfile certs/san.ext -out certs/server.pem 2>/dev/null
# the SuperNodes' key pairs: one to register, one never registered
ssh-keygen -q -t ecdsa -b 384 -N "" -f keys/member
ssh-keygen -q -t ecdsa -b 384 -N "" -f keys/stranger

export FLWR_HOME="$WORK/home"
cat > home/config.toml <<TOML
[superlink]
default = "local"

[superlink.local]
address = "127.0.0.1:$PORT"
root-certificates = "$WORK/certs/ca.crt"
TOML

flower-superlink --ssl-ca-certfile certs/ca.crt --ssl-certfile certs/server.pem --ssl-keyfile certs/server.key \
  --enable-supernode-auth --disable-runtime-dependency-installation --port "$PORT" --database "$WORK/superlink.db" > superlink.log 2>&1 &
PIDS+=($!)
for _ in $(seq 120); do  # until the SuperLink answers over TLS (at most 60 s)
  flwr supernode ls local > /dev/null 2>&1 && break
  sleep 0.5
done

flwr supernode register keys/member.pub local 2>&1 | tee register.log
MEMBER="$(grep -oE 'SuperNode [0-9]+ registered' register.log | grep -oE '[0-9]+' || true)"
[ -n "$MEMBER" ] || { echo "[auth] the registration failed"; tail -20 superlink.log; exit 1; }

flower-supernode --superlink "127.0.0.1:$PORT" --root-certificates certs/ca.crt \
  --auth-supernode-private-key keys/member --node-config "partition-id=0" --port "$(free_port)" > member.log 2>&1 &
PIDS+=($!)
flower-supernode --superlink "127.0.0.1:$PORT" --root-certificates certs/ca.crt \
  --auth-supernode-private-key keys/stranger --node-config "partition-id=1" --port "$(free_port)" \
  --max-retries 2 > stranger.log 2>&1 &
STRANGER=$!
PIDS+=($STRANGER)

status=1
for _ in $(seq 120); do  # until the member is online (at most 60 s)
  if flwr supernode ls local --format json > nodes.json 2>/dev/null && python3 - "$MEMBER" nodes.json <<'PY'
import json, sys
member, nodes = sys.argv[1], json.load(open(sys.argv[2]))
rows = nodes.get("nodes", nodes) if isinstance(nodes, dict) else nodes
online = [str(row.get("node-id", row.get("node_id"))) for row in rows if row.get("status") == "online"]
sys.exit(0 if online == [member] else 1)
PY
  then status=0; break; fi
  sleep 0.5
done
if [ "$status" -ne 0 ]; then
  echo "[auth] the registered SuperNode $MEMBER did not come online (or another node did)"
  cat nodes.json 2>/dev/null || true; tail -20 superlink.log; tail -20 member.log; exit 1
fi
for _ in $(seq 120); do kill -0 "$STRANGER" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$STRANGER" 2>/dev/null; then
  echo "[auth] the unregistered SuperNode is still running after its retries"; tail -20 stranger.log; exit 1
fi
if ! grep -q "ApiError:2004" superlink.log; then
  echo "[auth] the SuperLink did not refuse the unregistered key"; tail -30 superlink.log; exit 1
fi
echo "[auth] ok: registered SuperNode $MEMBER online over TLS, unregistered key refused"
