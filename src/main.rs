//! The `replayproof` binary: the stock command line, with the built-in effects.

fn main() -> std::process::ExitCode {
    replayproof::Cli::new().run()
}
