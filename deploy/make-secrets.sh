#!/usr/bin/env bash
# Creates the secrets of the local stack (deploy/compose.yaml) in deploy/secrets/,
# or in the folder given as the first argument: the cluster secret (HMAC key of
# agent connections), the metadata service's gRPC and admin tokens, the
# daemons' admin token (POST /v1/drain) and Grafana's admin password.
# A file that exists is kept, so running it again changes nothing; delete the
# folder to rotate everything. The folder is not committed (deploy/.gitignore).
#   ./deploy/make-secrets.sh
set -euo pipefail
dir="${1:-$(dirname "$0")/secrets}"
mkdir -p "$dir"
# Only the owner can list or enter the folder. The files themselves are
# world-readable because compose bind-mounts them as they are, and the
# containers' users (kvx 10001, Prometheus 65534, Grafana 472) are not the
# owner; the folder's mode keeps other users of this machine out.
chmod 700 "$dir"
random_hex() {
    # 32 random bytes as 64 hex characters: kvx wants tokens of 16 characters or more.
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n'
}
made=0
for name in cluster-secret metadata-token metadata-admin-token daemon-admin-token grafana-admin-password; do
    path="$dir/$name"
    if [ -s "$path" ]; then
        continue
    fi
    # No trailing newline: every reader gets exactly the bytes written.
    (umask 022 && random_hex >"$path.tmp" && mv "$path.tmp" "$path")
    made=$((made + 1))
done
echo "make-secrets.sh: $made new, $((5 - made)) kept in $dir"
