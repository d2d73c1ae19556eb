//! Runs one test alone in a child process of this test binary.
//!
//! Failpoints are global to a process, and every test of this binary shares the process: a
//! failpoint one test configures would fire in another's consumer. A failpoint scenario
//! therefore runs in a child process that runs only that test.

/// The variable that tells a child which test it runs.
const CHILD: &str = "REPLAYPROOF_ISOLATED_TEST";

/// True in the child, where the scenario runs. In the parent, runs `test` (its path in this
/// binary, such as `failpoints::a_scenario`) in a child, fails if the child failed, and
/// returns false.
pub fn in_child_process(test: &str) -> bool {
    if std::env::var(CHILD).as_deref() == Ok(test) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, test)
        .output()
        .expect("running the test in a child process");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{test} failed in its own process:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    false
}
