# Build: the release binary, with librdkafka compiled in.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
# The compile-time checked queries build from the committed query data, with no database.
COPY .cargo ./.cargo
COPY .sqlx ./.sqlx
COPY src ./src
COPY migrations ./migrations
COPY examples ./examples
COPY benches ./benches
ENV SQLX_OFFLINE=true
RUN cargo build --release --locked --bin replayproof

# Run: a small image, as a user without privileges.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home replayproof
COPY --from=build /src/target/release/replayproof /usr/local/bin/replayproof
USER replayproof
ENTRYPOINT ["/usr/local/bin/replayproof"]
