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
# Stripped, the dependencies too so the cooked layer matches: the symbols and debug lines the
# release profile keeps for local profiling would make the binary 153 MB instead of about 22.
ENV CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_DEBUG=0
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
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="replayproof" \
      org.opencontainers.image.description="Makes webhook redeliveries harmless: claim and effect in one PostgreSQL transaction, Kafka offsets only after the commit." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="MIT OR Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home replayproof
COPY --from=build /src/target/release/replayproof /usr/local/bin/replayproof
USER replayproof
ENTRYPOINT ["/usr/local/bin/replayproof"]
