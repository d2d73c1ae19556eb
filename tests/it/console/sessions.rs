//! Console sessions kept on the server: a copied cookie opens nothing after logout, and a
//! changed password_hash ends every session opened with the old one.

use crate::harness::console::{settings, TestConsole};
use crate::harness::TestDb;
use replayproof::console::{self, HashParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_cookie_opens_nothing_after_logout() {
    let db = TestDb::new().await;
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let mut copy = console.anonymous();
    copy.cookie = ann.cookie.clone();
    assert_eq!(
        copy.get("/").await.status,
        200,
        "the copy works while ann is in"
    );
    assert_eq!(ann.post("/logout", &[]).await.status, 303);
    let after = copy.get("/").await;
    assert_eq!(after.status, 303, "{}", after.body);
    assert_eq!(after.location.as_deref(), Some("/login"));
    // Another session of ann's is its own: logging out of one ends only it.
    let first = console.login("ann").await;
    let second = console.login("ann").await;
    assert_eq!(first.post("/logout", &[]).await.status, 303);
    assert_eq!(second.get("/").await.status, 200);
    assert_eq!(
        db.count("SELECT count(*) FROM console_sessions WHERE revoked_at IS NOT NULL")
            .await,
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_password_hash_ends_the_sessions_opened_with_the_old_one() {
    let db = TestDb::new().await;
    let first = settings();
    let mut changed = first.clone();
    let before = TestConsole::start(&db, first).await;
    let ann = before.login("ann").await;
    let vic = before.login("vic").await;
    drop(before);
    // The console again, with the same session key and a new hash for ann.
    let cheap = HashParams::new(1024, 1, 1, None).unwrap();
    changed.users[0].password_hash = Some(console::hash_password_with("new-pass", cheap).unwrap());
    let after = TestConsole::start(&db, changed).await;
    let mut ann_again = after.anonymous();
    ann_again.cookie = ann.cookie.clone();
    assert_eq!(
        ann_again.get("/").await.status,
        303,
        "ann's old session is over"
    );
    let mut vic_again = after.anonymous();
    vic_again.cookie = vic.cookie.clone();
    assert_eq!(
        vic_again.get("/").await.status,
        200,
        "vic's password did not change"
    );
}
