# Build: the release binary, with librdkafka and OpenSSL compiled in. cargo-chef builds the
# dependencies (librdkafka, OpenSSL, sqlx, ...) in a layer of their own that only a change to
# Cargo.toml or Cargo.lock rebuilds; a source change rebuilds replayproof alone.
FROM rust:1.95-bookworm AS chef
RUN cargo install cargo-chef --version 0.1.71 --locked
WORKDIR /src

FROM chef AS plan
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS build
COPY --from=plan /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --bin replayproof --recipe-path recipe.json
COPY Cargo.toml Cargo.lock build.rs ./
# The compile-time checked queries build from the committed query data, with no database.
COPY .cargo ./.cargo
COPY .sqlx ./.sqlx
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
COPY benches ./benches
ENV SQLX_OFFLINE=true
RUN cargo build --release --locked --bin replayproof

# Run: a small image, as a user without privileges. ca-certificates are the roots the
# dispatcher and the PostgreSQL client trust for TLS (OpenSSL is linked in for Kafka).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home replayproof
COPY --from=build /src/target/release/replayproof /usr/local/bin/replayproof
USER replayproof
ENTRYPOINT ["/usr/local/bin/replayproof"]
