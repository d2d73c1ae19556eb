use clap::Parser;

fn main() -> std::process::ExitCode {
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = replayproof::cli::Cli::parse();
    match cli.command {
        // The demo speaks through its progress bars and report; only problems are logged.
        replayproof::cli::Command::Demo(_) => replayproof::telemetry::init_logging_with("warn"),
        _ => replayproof::telemetry::init_logging(),
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("replayproof: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(replayproof::cli::run(cli));
    // A worker thread stuck in a call that never returns must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "replayproof stopped on an error.");
            std::process::ExitCode::FAILURE
        }
    }
}
