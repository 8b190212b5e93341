#!/usr/bin/env bash
# Prints the two Secrets the Kubernetes base reads (docs/kubernetes.md), for the in-cluster Redis:
#   deploy/k8s/make-secrets.sh [NAMESPACE [LANES]] | kubectl apply -n NAMESPACE -f -
# streamrl-redis: a password per Redis ACL user (streamrl.ops.redis_acl), each service's
#   redis:// URL with its own user, and KEDA's login (the read-only observer; the address as seen from
#   KEDA's namespace). With LANES = K > 1 (overlays/lanes), also each service's URL of lane k's Redis
#   (url-<service>-lanek, the Service redis-lanek; lane 0's is the home's, url-<service>) and KEDA's
#   address of it (keda-address-lanek), for k = 1..K-1: the same users and passwords on every lane.
# streamrl-keys: the weights key (signs the learner's weights events), the bearer token of the
#   /metrics endpoints, and HF_TOKEN when it is set in the environment.
# New random values each time, except a password already in STREAMRL_REDIS_PASSWORD_<USER> (as in
# compose's .env). Redis reads the passwords when its pod starts: after replacing them, restart it
# and the services (docs/kubernetes.md). The values go to stdout only: pipe them, do not keep them.
set -euo pipefail
NAMESPACE=${1:-streamrl}
LANES=${2:-1}
if ! [[ $LANES =~ ^[1-9][0-9]*$ ]]; then
  echo "make-secrets.sh: LANES must be a whole number >= 1 (the recipe's lanes.count), not '$LANES'" >&2
  exit 2
fi
USERS=(coordinator rollout reward learner observer)
SERVICES=(coordinator rollout reward learner)

random_hex() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }

declare -A password
for user in "${USERS[@]}"; do
  var="STREAMRL_REDIS_PASSWORD_${user^^}"
  password[$user]=${!var:-$(random_hex 24)}
done

cat <<YAML
apiVersion: v1
kind: Secret
metadata:
  name: streamrl-redis
type: Opaque
stringData:
YAML
for user in "${USERS[@]}"; do
  echo "  password-$user: \"${password[$user]}\""
done
for service in "${SERVICES[@]}"; do
  echo "  url-$service: \"redis://$service:${password[$service]}@redis:6379/0\""
done
cat <<YAML
  keda-address: "redis.$NAMESPACE.svc:6379"
  keda-username: "observer"
YAML
for ((lane = 1; lane < LANES; lane++)); do
  for service in "${SERVICES[@]}"; do
    echo "  url-$service-lane$lane: \"redis://$service:${password[$service]}@redis-lane$lane:6379/0\""
  done
  echo "  keda-address-lane$lane: \"redis-lane$lane.$NAMESPACE.svc:6379\""
done
cat <<YAML
---
apiVersion: v1
kind: Secret
metadata:
  name: streamrl-keys
type: Opaque
stringData:
  weights-key: "$(random_hex 32)"
  metrics-token: "$(random_hex 32)"
YAML
if [ -n "${HF_TOKEN:-}" ]; then
  echo "  hf-token: \"$HF_TOKEN\""
fi
