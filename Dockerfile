# Build: the release binary, with librdkafka and OpenSSL compiled in. cargo-chef builds the
# dependencies (librdkafka, OpenSSL, sqlx, ...) in a layer of their own that only a change to
# Cargo.toml or Cargo.lock rebuilds; a source change rebuilds the binary alone.
#
#   docker build -t replayproof .                           # replayproof itself
#   docker build --build-arg BIN=orders -t orders .         # the orders example
#
# BIN names the binary the image runs. A program of examples/ (examples/orders.rs) is built
# with --example, and its dependencies are cooked with --examples, since an example also links
# the dev-dependencies; anything else is a [[bin]] target (replayproof, or the binary of your
# own crate built on replayproof::Cli, docs/library.md), cooked and built with --bin. Whatever
# its name, it is installed as /usr/local/bin/replayproof: the entrypoint and every health
# check (docker-compose.yml, deploy/kubernetes) name that path.
ARG BIN=replayproof

FROM rust:1.95-bookworm AS chef
RUN cargo install cargo-chef --version 0.1.71 --locked
WORKDIR /src

FROM chef AS plan
ARG BIN
COPY . .
# The recipe, and which kind of target BIN is: cargo's arguments for the cook and the build,
# and where the build leaves the binary, in target.sh.
RUN cargo chef prepare --recipe-path recipe.json \
 && case "$BIN" in ""|*[!A-Za-z0-9_-]*) echo "BIN=$BIN is not a target's name" >&2; exit 1;; esac \
 && if [ -f "examples/$BIN.rs" ] || [ -f "examples/$BIN/main.rs" ]; then \
      printf 'cook="--examples"\nbuild="--example %s"\nbuilt="examples/%s"\n' "$BIN" "$BIN"; \
    else \
      printf 'cook="--bin %s"\nbuild="--bin %s"\nbuilt="%s"\n' "$BIN" "$BIN" "$BIN"; \
    fi > target.sh

FROM chef AS build
COPY --from=plan /src/recipe.json /src/target.sh ./
# Stripped, the dependencies too so the cooked layer matches: the symbols and debug lines the
# release profile keeps for local profiling would make the binary 153 MB instead of about 22.
ENV CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_DEBUG=0
RUN . ./target.sh && cargo chef cook --release --locked $cook --recipe-path recipe.json
COPY Cargo.toml Cargo.lock build.rs ./
# The compile-time checked queries build from the committed query data, with no database.
COPY .cargo ./.cargo
COPY .sqlx ./.sqlx
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
COPY benches ./benches
ENV SQLX_OFFLINE=true
RUN . ./target.sh && cargo build --release --locked $build \
 && cp "target/release/$built" image-binary

# Run: a small image, as a user without privileges. ca-certificates are the roots the
# dispatcher and the PostgreSQL client trust for TLS (OpenSSL is linked in for Kafka).
FROM debian:bookworm-slim
ARG BIN
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="${BIN}" \
      org.opencontainers.image.description="Makes webhook redeliveries harmless: claim and effect in one PostgreSQL transaction, Kafka offsets only after the commit." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="MIT OR Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home replayproof
COPY --from=build /src/image-binary /usr/local/bin/replayproof
USER replayproof
ENTRYPOINT ["/usr/local/bin/replayproof"]
