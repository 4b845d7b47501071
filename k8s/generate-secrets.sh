#!/usr/bin/env bash
# Generate the credentials of the k8s example at deploy time, into k8s/base/secrets/ (ignored by
# git), where k8s/base/kustomization.yaml's secretGenerator reads them:
#   tokens             auth.tokens_file: "engine SHA256HEX" (the hash of the token, never it)
#   engine-token       the bearer token engines and Prometheus send (KVSTORE_TOKEN)
#   integrity-secrets  integrity.secrets: the block MAC key every node sharing a Redis needs
# Each is 32 random bytes from /dev/urandom, hex-encoded, written mode 0600 without a newline.
# Files that exist are kept (run it again: nothing changes); --force makes new ones (rotation:
# every store and engine then needs a restart with the new Secret).
#
#   k8s/generate-secrets.sh && kubectl apply -k k8s/base
set -euo pipefail

dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/base/secrets"
force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

random_hex() { od -An -v -tx1 -N32 /dev/urandom | tr -d ' \n'; }
sha256_hex() {
  if command -v sha256sum >/dev/null; then printf %s "$1" | sha256sum | cut -d' ' -f1
  else printf %s "$1" | shasum -a 256 | cut -d' ' -f1; fi
}

mkdir -p "$dir"
umask 077
if [[ $force == 0 && -s "$dir/tokens" && -s "$dir/engine-token" && -s "$dir/integrity-secrets" ]]
then
  echo "kept the credentials in $dir (--force makes new ones)"
  exit 0
fi
token="$(random_hex)"
printf 'engine %s\n' "$(sha256_hex "$token")" > "$dir/tokens"
printf %s "$token" > "$dir/engine-token"
printf %s "$(random_hex)" > "$dir/integrity-secrets"
echo "wrote new credentials to $dir: keep them out of git; kubectl apply -k k8s/base now uses them"
