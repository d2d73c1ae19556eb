#!/usr/bin/env bash
# Measures the ingress from outside: wrk (Debian's package) drives the release `replayproof
# ingest` process against librdkafka's mock cluster and against nisshi, next to the same
# server's bare /healthz and a bare produce loop on the same broker (benches/ingest.rs says
# what each run is). Installs what it needs, once: wrk, and nisshi 0.8.1 (nightly toolchain).
#
#   ./scripts/bench-ingest.sh                     # 3 rounds of 10 s per run, medians
#   BENCH_SECONDS=5 BENCH_ROUNDS=1 ./scripts/bench-ingest.sh
#
# The table it prints is the one in docs/performance.md. Takes about 15 minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/replayproof/target}"
NISSHI_VERSION=0.8.1

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if ! command -v wrk >/dev/null; then
  echo "==> Installing Debian's wrk (the load generator; once)" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null
fi

nisshi_ok() { command -v "$1" >/dev/null && "$1" --version 2>/dev/null | grep -q "$NISSHI_VERSION"; }
nisshi="${REPLAYPROOF_NISSHI:-$(command -v nisshi || echo "${CARGO_HOME:-$HOME/.cargo}/bin/nisshi")}"
if ! nisshi_ok "$nisshi"; then
  echo "==> Installing nisshi $NISSHI_VERSION (a Kafka-protocol broker; about 20 minutes once)" >&2
  cargo +nightly install nisshi --version "$NISSHI_VERSION" --locked
  nisshi="${CARGO_HOME:-$HOME/.cargo}/bin/nisshi"
fi
export REPLAYPROOF_NISSHI="$nisshi"

export SQLX_OFFLINE=true
exec cargo bench --bench ingest "$@"
