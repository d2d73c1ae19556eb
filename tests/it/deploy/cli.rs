//! The command line as a person meets it: shell completion, the manual pages, and what a
//! failed command prints.

use std::process::{Command, Output, Stdio};

fn replayproof(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args(args)
        .env_remove("REPLAYPROOF_CONFIG")
        .env_remove("REPLAYPROOF_LOG_FORMAT")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// What bash offers after `words`, the last of them being completed, with the script
/// `replayproof completions bash` printed loaded as a user's shell would load it.
fn bash_completes(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let words: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let program = format!(
        "source '{}'\nCOMP_WORDS=({})\nCOMP_CWORD={}\nCOMP_LINE=\"${{COMP_WORDS[*]}}\"\n\
         COMP_POINT=${{#COMP_LINE}}\n_replayproof replayproof \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        words.join(" "),
        words.len() - 1,
    );
    let out = Command::new("bash")
        .args(["--norc", "--noprofile", "-c", &program])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn bash_completes_commands_and_flags_from_the_printed_script() {
    let out = replayproof(&["completions", "bash"]);
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("replayproof.bash");
    std::fs::write(&script, &out.stdout).unwrap();

    let commands = bash_completes(&script, &["replayproof", "con"]);
    assert!(commands.contains(&"consume".to_owned()), "{commands:?}");
    assert!(commands.contains(&"config".to_owned()), "{commands:?}");
    assert!(!commands.contains(&"ingest".to_owned()), "{commands:?}");

    let flags = bash_completes(&script, &["replayproof", "consume", "--batch"]);
    assert!(flags.contains(&"--batch-size".to_owned()), "{flags:?}");
    assert!(flags.contains(&"--batch-timeout".to_owned()), "{flags:?}");

    let nested = bash_completes(&script, &["replayproof", "events", "re"]);
    assert!(nested.contains(&"retry".to_owned()), "{nested:?}");
    assert!(nested.contains(&"resolve".to_owned()), "{nested:?}");

    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let out = replayproof(&["completions", shell]);
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("replayproof") && text.contains("batch-size"),
            "{shell}"
        );
    }
    let unknown = replayproof(&["completions", "tcsh"]);
    assert_eq!(unknown.status.code(), Some(2));
}

#[test]
fn the_manual_pages_cover_every_command_and_groff_reads_them_without_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let pages = dir.path().join("man1");
    let out = replayproof(&["man", "--out-dir", pages.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for page in [
        "replayproof.1",
        "replayproof-consume.1",
        "replayproof-ingest.1",
        "replayproof-dispatch.1",
        "replayproof-events-retry.1",
        "replayproof-config-check.1",
        "replayproof-completions.1",
    ] {
        let path = pages.join(page);
        assert!(path.exists(), "{page} is missing");
        // groff renders it as man(1) would (preconv reading UTF-8 first), warnings on: a page
        // it cannot read says so.
        let rendered = Command::new("groff")
            .args(["-k", "-man", "-Tutf8", "-ww", "-z"])
            .arg(&path)
            .output()
            .expect("groff (Debian's groff-base) renders the pages");
        assert!(rendered.status.success(), "{page}");
        assert_eq!(
            String::from_utf8_lossy(&rendered.stderr),
            "",
            "{page}: groff's warnings"
        );
    }
    let consume = std::fs::read_to_string(pages.join("replayproof-consume.1")).unwrap();
    assert!(
        consume.contains("batch\\-size"),
        "every flag is in the page"
    );

    // Without --out-dir, the main page goes to stdout.
    let out = replayproof(&["man"]);
    assert!(out.status.success());
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(page.contains("\n.TH replayproof 1 "), "{page}");
}

#[test]
fn a_failed_command_prints_one_error_line_with_its_causes_and_no_password() {
    let url = format!(
        "postgres://nobody:hunter2-never-printed@127.0.0.1:{}/none",
        crate::harness::free_port()
    );
    let out = replayproof(&["migrate", "--database-url", &url]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("hunter2-never-printed"), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("error") || l.contains("ERROR"))
        .collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    let line = errors[0];
    assert!(
        line.starts_with("error: "),
        "no log line's timestamp: {line}"
    );
    // What failed and why, on the one line: the refusal itself, not only a pool's time-out.
    assert!(
        line.starts_with("error: reading the search_path: "),
        "{line}"
    );
    assert!(line.to_lowercase().contains("refused"), "{line}");
}

#[test]
fn a_reader_that_goes_away_ends_completions_and_man_quietly() {
    // `replayproof completions bash | head -1`, with the reader gone before the first write.
    for args in [&["completions", "bash"][..], &["man"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {said}");
        assert!(said.is_empty(), "{args:?}: {said}");
    }
}

/// A database a newer release migrated: `migrate` refuses, naming the version it does not know;
/// `migrate --allow-newer` (the Kubernetes init containers' way) goes on with a warning.
#[tokio::test]
async fn migrate_over_a_newer_database_is_refused_unless_allowed() {
    let db = crate::harness::TestDb::new().await;
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES (29991231000001, 'from a newer release', true, '\\x00', 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let refused = replayproof(&["migrate", "--database-url", &db.url]);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(said.contains("29991231000001"), "{said}");
    let allowed = replayproof(&["migrate", "--allow-newer", "--database-url", &db.url]);
    let said = String::from_utf8_lossy(&allowed.stderr);
    assert!(allowed.status.success(), "{said}");
    assert!(said.contains("does not know"), "{said}");
}
