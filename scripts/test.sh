#!/usr/bin/env bash
# Runs every check and test of replayproof, on a fresh machine too.
#
# What the tests need, this script provides and stops again on exit:
#   - PostgreSQL: DATABASE_URL when set; otherwise a throwaway cluster from the local
#     PostgreSQL binaries (Debian's `postgresql` package is installed when they are missing).
#   - A Kafka-protocol broker process for the end-to-end tests: KAFKA_BROKERS when set;
#     otherwise nisshi 0.8.1, installed with `cargo +nightly install` when missing.
#     The fast tests use librdkafka's in-process mock cluster and need nothing.
#   - promtool, from Debian's `prometheus` package (installed when missing), to check the alert
#     rules in deploy/ and run their unit tests.
#   - sqlx-cli (pinned), installed with `cargo install` when missing, to check that the
#     committed `.sqlx/` query data matches the queries and migrations.
#   - kubernetes-validate and checkov (pinned, from PyPI, installed when missing), to check the
#     manifests of deploy/kubernetes/ against the Kubernetes schemas and a security linter;
#     both run offline.
#   - kubectl (1.27 or later, not installed by this script) renders deploy/kubernetes with
#     kustomize for those checkers and for tests/it/deploy/kustomize.rs.
#   - Debian's pgbouncer (installed when missing): the pooler test runs every guarantee through
#     PgBouncer in transaction mode.
#   - groff (Debian's groff-base, installed when missing), which renders the manual pages.
#   - Debian's chromium and chromium-driver (installed when missing): the console's browser test
#     drives a real browser through WebDriver.
#   - cargo-audit (pinned, installed when missing) when a copy of the RustSec advisory database
#     is on disk (REPLAYPROOF_ADVISORY_DB, or ../shared/advisory-db): it cannot be fetched here.
# Then: formatting, the query data, clippy with warnings denied, the structure check
# (scripts/structure.py), a library build without the default features, and `cargo test`
# with the failpoints compiled in.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/replayproof/target}"
NISSHI_VERSION=0.8.1
SQLX_CLI_VERSION=0.8.6

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root to run: $*"
  fi
}

# Installs Debian packages, the package lists read first.
apt_install() {
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for_port() { # port seconds
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  return 1
}

work=$(mktemp -d "${TMPDIR:-/tmp}/replayproof-test.XXXXXX")
chmod 755 "$work"
nisshi_pid=""
pg_dir=""
pg_user=""

cleanup() {
  if [ -n "$nisshi_pid" ]; then kill "$nisshi_pid" 2>/dev/null || true; wait "$nisshi_pid" 2>/dev/null || true; fi
  if [ -n "$pg_dir" ]; then pg_run "$pg_bin/pg_ctl" -D "$pg_dir/data" -m immediate -w stop >/dev/null 2>&1 || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------- PostgreSQL
pg_bindir() {
  local d
  d=$(pg_config --bindir 2>/dev/null || true)
  if [ -n "$d" ] && [ -x "$d/initdb" ]; then echo "$d"; return; fi
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V); do
    [ -x "$d/initdb" ] && echo "$d" && return
  done
  return 0
}

pg_run() {
  if [ -n "$pg_user" ]; then runuser -u "$pg_user" -- "$@"; else "$@"; fi
}

# The restart test starts clusters of its own, so the binaries are needed even with DATABASE_URL.
ensure_postgres_binaries() {
  pg_bin=$(pg_bindir | tail -n 1)
  if [ -z "$pg_bin" ]; then
    log "Installing Debian's postgresql package (no PostgreSQL server binaries found)"
    apt_install postgresql
    pg_bin=$(pg_bindir | tail -n 1)
    [ -n "$pg_bin" ] || die "PostgreSQL binaries still missing after installing postgresql"
  fi
  export REPLAYPROOF_PG_BINDIR="$pg_bin"
}

start_postgres() {
  pg_dir="$work/pg"
  mkdir -p "$pg_dir"
  if [ "$(id -u)" -eq 0 ]; then
    pg_user=postgres
    id -u postgres >/dev/null 2>&1 || as_root useradd --system --no-create-home postgres
    chown postgres: "$pg_dir"
  fi
  local port
  port=$(free_port)
  log "Starting a throwaway PostgreSQL ($pg_bin) on port $port"
  pg_run "$pg_bin/initdb" -D "$pg_dir/data" -U postgres --auth=trust -E UTF8 --no-sync >"$work/initdb.log" 2>&1 \
    || { cat "$work/initdb.log" >&2; die "initdb failed"; }
  pg_run "$pg_bin/pg_ctl" -D "$pg_dir/data" -l "$pg_dir/postgres.log" -w \
    -o "-p $port -k $pg_dir -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300 -c max_prepared_transactions=16" start >/dev/null \
    || { cat "$pg_dir/postgres.log" >&2; die "PostgreSQL did not start"; }
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
}

# -------------------------------------------------------------------------------------- nisshi
nisshi_bin() {
  local candidate
  for candidate in "$(command -v nisshi 2>/dev/null || true)" "${CARGO_HOME:-$HOME/.cargo}/bin/nisshi"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" --version 2>/dev/null | grep -q "$NISSHI_VERSION"; then
      echo "$candidate"; return
    fi
  done
  return 0
}

start_nisshi() {
  local bin port
  bin=$(nisshi_bin)
  if [ -z "$bin" ]; then
    log "Installing nisshi $NISSHI_VERSION (a Kafka-protocol broker; takes about 12 minutes once)"
    if rustup toolchain list | grep -q '^nightly' && cargo +nightly install nisshi --version "$NISSHI_VERSION" --locked; then
      bin=$(nisshi_bin)
    fi
    if [ -z "$bin" ]; then
      # Said loudly, not hidden: the process tests then host librdkafka's mock cluster instead.
      log "WARNING: nisshi $NISSHI_VERSION could not be installed (it needs a nightly toolchain, rustc 1.96+);" \
        "the end-to-end tests run against the in-process mock cluster instead"
      return 0
    fi
  fi
  port=$(free_port)
  log "Starting nisshi on port $port"
  "$bin" broker --listener-url "tcp://127.0.0.1:$port" --advertised-listener-url "tcp://127.0.0.1:$port" \
    --storage-engine memory://nisshi/ --group-initial-rebalance-delay 0s >"$work/nisshi.log" 2>&1 &
  nisshi_pid=$!
  wait_for_port "$port" 30 || { cat "$work/nisshi.log" >&2; die "nisshi did not start"; }
  export KAFKA_BROKERS="127.0.0.1:$port"
  # The TLS and SASL test starts secured brokers of its own from the same binary.
  export REPLAYPROOF_NISSHI="$bin"
}

# The compose file and the envelope's schema are validated in Python (jsonschema); the input
# tests write CloudEvents with the CloudEvents SDK's own Kafka binding over confluent-kafka, as
# docs/inputs.md's producer does.
CLOUDEVENTS_VERSION=2.2.0
CONFLUENT_KAFKA_VERSION=2.16.2

ensure_python_modules() {
  # rfc3339-validator: without it jsonschema passes every date-time unchecked.
  if ! python3 -c 'import yaml, jsonschema, rfc3339_validator' 2>/dev/null; then
    log "Installing PyYAML, jsonschema and rfc3339-validator for the compose file's and the envelope's schemas"
    python3 -m pip install --quiet pyyaml jsonschema rfc3339-validator
  fi
  if ! python3 -m pip show cloudevents 2>/dev/null | grep -q "^Version: $CLOUDEVENTS_VERSION" \
    || ! python3 -m pip show confluent-kafka 2>/dev/null | grep -q "^Version: $CONFLUENT_KAFKA_VERSION"; then
    log "Installing cloudevents $CLOUDEVENTS_VERSION and confluent-kafka $CONFLUENT_KAFKA_VERSION (once)"
    python3 -m pip install --quiet "cloudevents==$CLOUDEVENTS_VERSION" "confluent-kafka==$CONFLUENT_KAFKA_VERSION"
  fi
}

# ------------------------------------------------------------------------- Kubernetes checkers
KUBERNETES_VALIDATE_VERSION=1.37.0
CHECKOV_VERSION=3.3.30

ensure_kubernetes_checkers() {
  if ! python3 -m pip show kubernetes-validate 2>/dev/null | grep -q "^Version: $KUBERNETES_VALIDATE_VERSION" \
    || ! python3 -m pip show checkov 2>/dev/null | grep -q "^Version: $CHECKOV_VERSION"; then
    log "Installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION and checkov $CHECKOV_VERSION (once)"
    python3 -m pip install --quiet "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "checkov==$CHECKOV_VERSION"
  fi
  # The manifests are checked as they are applied, rendered by kubectl's kustomize (the tests
  # of tests/it/deploy/kustomize.rs render them too).
  command -v kubectl >/dev/null \
    || die "kubectl is missing: install kubectl 1.27 or later, which renders deploy/kubernetes with kustomize"
}

# The manifests as they are applied: the base, each component over the base, and the example
# overlay, each rendered by kubectl's kustomize. kubernetes-validate checks each rendering's
# objects against the schemas of its Kubernetes version, but the Prometheus Operator's (whose
# kinds have none there: their content is checked by tests/it/deploy/kubernetes.rs); checkov,
# the security linter, reads every rendering.
check_kubernetes_manifests() {
  local work component name
  work=$(mktemp -d)
  mkdir "$work/rendered" "$work/checked"
  cp -r deploy/kubernetes "$work/tree"
  kubectl kustomize "$work/tree" >"$work/rendered/base.yaml"
  kubectl kustomize "$work/tree/overlays/example" >"$work/rendered/overlay.yaml"
  for component in "$work"/tree/components/*/; do
    name=$(basename "$component")
    mkdir "$work/tree/with-$name"
    printf 'resources: [../base]\ncomponents: [../components/%s]\n' "$name" \
      >"$work/tree/with-$name/kustomization.yaml"
    kubectl kustomize "$work/tree/with-$name" >"$work/rendered/with-$name.yaml"
  done
  python3 - "$work/rendered" "$work/checked" <<'EOF'
import pathlib, sys, yaml
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.yaml")):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    kept = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    (pathlib.Path(sys.argv[2]) / path.name).write_text(yaml.safe_dump_all(kept))
EOF
  python3 -m kubernetes_validate --strict --quiet "$work"/checked/*.yaml
  python3 -m checkov.main -d "$work/rendered" --framework kubernetes --quiet --compact --skip-download
  rm -rf "$work"
}

# ------------------------------------------------------------------------------------ AsyncAPI
# docs/asyncapi.yaml through the official parser (@asyncapi/parser, pinned with its lock file in
# scripts/asyncapi/): its references resolved, its errors and warnings fatal, its examples
# checked against their schemas. Node.js and npm come from Debian when missing; the packages are
# installed again only when the package files changed, without install scripts (none is needed).
check_asyncapi() {
  local dir=scripts/asyncapi
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    log "Installing Debian's nodejs and npm (the AsyncAPI parser runs on Node.js; once)"
    apt_install nodejs npm
  fi
  if ! cat "$dir/package.json" "$dir/package-lock.json" | cmp -s - "$dir/node_modules/.installed-from"; then
    log "Installing the AsyncAPI parser (npm ci in $dir)"
    npm ci --prefix "$dir" --no-audit --no-fund --ignore-scripts --loglevel=error
    cat "$dir/package.json" "$dir/package-lock.json" >"$dir/node_modules/.installed-from"
  fi
  node "$dir/validate.mjs" docs/asyncapi.yaml
}

# ------------------------------------------------------------------------------------ promtool
ensure_promtool() {
  if ! command -v promtool >/dev/null; then
    log "Installing Debian's prometheus package (for promtool; once)"
    apt_install prometheus
    command -v promtool >/dev/null || die "promtool still missing after installing prometheus"
  fi
}

# ------------------------------------------------------------------------------------- groff
# The manual pages are rendered by groff, as man(1) renders them, to catch a page it cannot read.
ensure_groff() {
  if ! command -v groff >/dev/null || ! command -v preconv >/dev/null; then
    log "Installing Debian's groff-base package (renders the manual pages; once)"
    apt_install groff-base
  fi
}

# ----------------------------------------------------------------------------------- pgbouncer
# The pooler test (tests/it/pooler.rs) starts Debian's PgBouncer in transaction mode in front of
# the throwaway cluster, as a managed platform's pooler stands in front of its database.
ensure_pgbouncer() {
  if [ -z "$(pgbouncer_bin)" ]; then
    log "Installing Debian's pgbouncer package (the pooler test; once)"
    apt_install pgbouncer
    [ -n "$(pgbouncer_bin)" ] || die "pgbouncer still missing after installing it"
  fi
  REPLAYPROOF_PGBOUNCER=$(pgbouncer_bin)
  export REPLAYPROOF_PGBOUNCER
}

pgbouncer_bin() {
  command -v pgbouncer 2>/dev/null || { [ -x /usr/sbin/pgbouncer ] && echo /usr/sbin/pgbouncer; } || true
}

# ------------------------------------------------------------------------------------ chromium
ensure_chromium() {
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    log "Installing Debian's chromium and chromium-driver (the console's browser test; once)"
    apt_install chromium chromium-driver
    command -v chromedriver >/dev/null || die "chromedriver still missing after installing chromium-driver"
  fi
}

# ------------------------------------------------------------------------- RustSec advisories
# `cargo audit` checks Cargo.lock against the RustSec advisory database, which lives in a git
# repository (rustsec/advisory-db) this machine's network cannot reach. So it reads a copy on
# disk and fetches nothing: REPLAYPROOF_ADVISORY_DB when set, else shared/advisory-db beside
# the clone. Without a copy the check is reported as not run, loudly, and the rest goes on.
CARGO_AUDIT_VERSION=0.22.2

advisory_db() {
  local db="${REPLAYPROOF_ADVISORY_DB:-$(cd .. && pwd)/shared/advisory-db}"
  [ -d "$db/crates" ] && echo "$db"
  return 0
}

ensure_cargo_audit() {
  if ! cargo audit --version 2>/dev/null | grep -q "$CARGO_AUDIT_VERSION"; then
    log "Installing cargo-audit $CARGO_AUDIT_VERSION (checks the RustSec advisories; once)"
    cargo install cargo-audit --version "$CARGO_AUDIT_VERSION" --locked
  fi
}

check_advisories() {
  local db
  db=$(advisory_db)
  if [ -z "$db" ]; then
    log "NOT CHECKED: RustSec advisories (no advisory database: set REPLAYPROOF_ADVISORY_DB or" \
      "put a copy of rustsec/advisory-db at ../shared/advisory-db)"
    return 0
  fi
  ensure_cargo_audit
  log "RustSec advisories (cargo audit, the database at $db)"
  # An advisory ignored in .cargo/audit.toml for a crate no build compiles stays ignored only
  # while no build compiles it.
  if cargo tree -q -i rsa --all-features --target all -e all 2>/dev/null | grep -q .; then
    die "rsa is now compiled into a build: RUSTSEC-2023-0071 may no longer be ignored (.cargo/audit.toml)"
  fi
  cargo audit --db "$db" --no-fetch --file Cargo.lock
}

# ------------------------------------------------------------------------------------ sqlx-cli
ensure_sqlx_cli() {
  if ! cargo sqlx --version 2>/dev/null | grep -q "$SQLX_CLI_VERSION"; then
    log "Installing sqlx-cli $SQLX_CLI_VERSION (checks the committed query data; once)"
    cargo install sqlx-cli --version "$SQLX_CLI_VERSION" --locked --no-default-features \
      --features postgres,rustls
  fi
}

# The queries are checked against a database migrated from scratch, so `.sqlx/` must match
# both the code and the migrations.
check_query_data() {
  local name url base query=""
  name="rp_sqlx_check_$$"
  # The same server and parameters as DATABASE_URL, another database.
  base="${DATABASE_URL%%\?*}"
  [ "$base" = "$DATABASE_URL" ] || query="?${DATABASE_URL#*\?}"
  url="${base%/*}/$name$query"
  psql_admin "CREATE DATABASE $name"
  DATABASE_URL="$url" cargo sqlx migrate run --source migrations >/dev/null
  DATABASE_URL="$url" cargo sqlx prepare --check -- --all-features --lib
  psql_admin "DROP DATABASE $name"
}

psql_admin() {
  "$pg_bin/psql" "$DATABASE_URL" -v ON_ERROR_STOP=1 -q -c "$1"
}

# -------------------------------------------------------------------------------------- checks
ensure_python_modules
ensure_postgres_binaries
[ -n "${DATABASE_URL:-}" ] || start_postgres
[ -n "${KAFKA_BROKERS:-}" ] || start_nisshi
ensure_sqlx_cli
ensure_promtool
ensure_groff
ensure_chromium
ensure_pgbouncer
ensure_kubernetes_checkers
export SQLX_OFFLINE=true

log "The alert rules (promtool check rules, promtool test rules)"
promtool check rules deploy/alerts.yml
promtool test rules deploy/alerts.test.yml

log "The Kubernetes manifests (kubernetes-validate, checkov)"
check_kubernetes_manifests

log "The AsyncAPI document (@asyncapi/parser)"
check_asyncapi

check_advisories

log "cargo fmt --check"
cargo fmt --all -- --check
log "The committed query data (.sqlx) matches the queries and migrations"
check_query_data
log "cargo clippy (warnings denied, no function over 60 lines)"
cargo clippy --all-targets --all-features -- -D warnings
log "The structure: no file in src/ over 600 lines outside its tests, no import circle"
python3 scripts/structure.py
log "The API documentation (cargo doc, warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --all-features
log "The library alone, without the command line or the development kit"
cargo build --lib --no-default-features
log "The benchmarks build (they run with cargo bench, outside this script)"
cargo build --benches --all-features
# `cargo test` builds the example as its own test binary; the process tests run the example's
# real binary, built here.
log "The example binary (its processes are tested by tests/it)"
cargo build --examples --all-features
log "cargo test (broker process: ${KAFKA_BROKERS:-none, the mock cluster serves every test})"
cargo test --all-features --no-fail-fast "$@"
