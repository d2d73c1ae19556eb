//! What a role sees of what events carry. Payloads, and the errors that often quote them (a
//! claim's last error, an attempt's error, a deferral's reason, a dead letter's reason), go to
//! operators, and to viewers only with `show_payloads_to_viewers`
//! ([`super::auth::User::sees_payloads`]).

use maud::{html, Markup};

/// `text`, an error or a reason that may quote a payload, where the user sees payloads;
/// otherwise a note that it is hidden.
pub(crate) fn error_text(sees: bool, text: &str) -> Markup {
    match sees {
        true => html! { (text) },
        false => html! { span class="hidden" { "(hidden: errors are shown to operators only)" } },
    }
}
