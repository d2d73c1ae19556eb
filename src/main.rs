fn main() -> std::process::ExitCode {
    replayproof::Cli::new().run()
}
