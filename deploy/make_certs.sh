#!/usr/bin/env bash
# TLS certificates for a SuperLink and EC key pairs for SuperNode authentication.
#
#   deploy/make_certs.sh OUT_DIR NUM_NODES [HOST ...]
#
# OUT_DIR/ca.crt            the CA every SuperNode and `flwr` trust (--root-certificates)
# OUT_DIR/server.pem/.key   the SuperLink's certificate (SANs: localhost, 127.0.0.1, HOST ...)
# OUT_DIR/node-<i>, .pub    SuperNode i's private/public key (ECDSA P-384, OpenSSH format);
#                           register the .pub with `flwr supernode register`.
# Needs openssl and ssh-keygen. Existing files are kept, so reruns do not invalidate nodes.
set -euo pipefail
out=${1:?usage: make_certs.sh OUT_DIR NUM_NODES [HOST ...]}
nodes=${2:?usage: make_certs.sh OUT_DIR NUM_NODES [HOST ...]}
shift 2
mkdir -p "$out"
cd "$out"
san="DNS:localhost,IP:127.0.0.1"
for host in "$@"; do
  if [[ $host =~ ^[0-9.]+$ ]]; then san="$san,IP:$host"; else san="$san,DNS:$host"; fi
done
if [[ ! -f ca.crt ]]; then
  openssl genrsa -out ca.key 4096 2>/dev/null
  openssl req -new -x509 -key ca.key -sha256 -days 365 -subj "/CN=fedrec-flwr CA" -out ca.crt
fi
if [[ ! -f server.pem ]]; then
  openssl genrsa -out server.key 4096 2>/dev/null
  openssl req -new -key server.key -subj "/CN=fedrec-flwr SuperLink" -out server.csr
  printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n" \
    "$san" > server.ext
  openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -sha256 \
    -extfile server.ext -out server.pem 2>/dev/null
  rm -f server.csr server.ext
fi
for ((i = 0; i < nodes; i++)); do
  [[ -f node-$i ]] || ssh-keygen -q -t ecdsa -b 384 -N "" -C "" -f "node-$i"
done
chmod 600 ca.key server.key node-* 2>/dev/null || true
chmod 644 ./*.pub ca.crt server.pem
echo "certificates and $nodes node keys in $(pwd)"
