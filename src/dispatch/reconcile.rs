//! The reconcile request: asking the downstream whether an uncertain operation exists before
//! it is sent again ([`Dispatcher::reconcile`] reads the answer).

use super::{answer::describe, Dispatcher};
use crate::outbox::Leased;

impl Dispatcher {
    /// Asks `template` (its `{key}` the operation key) whether the operation exists. A
    /// credential bound to other origins never goes to it: then no request, and why.
    pub(super) async fn ask_reconcile(
        &self,
        row: &Leased,
        template: &str,
    ) -> Result<reqwest::Response, String> {
        let key = percent_encoding::utf8_percent_encode(
            &row.operation_key,
            percent_encoding::NON_ALPHANUMERIC,
        );
        let url = template.replace("{key}", &key.to_string());
        let destination = self.settings.destinations.of(&row.origin);
        let credentials = &self.settings.outbound.credentials;
        let headers = credentials.headers_for(row.credential.as_deref(), &url)?;
        let mut request = self
            .http
            .get(&url)
            .header(&destination.idempotency_header, &row.operation_key);
        for h in headers {
            request = request.header(h.name.clone(), h.value.clone());
        }
        request.send().await.map_err(|e| describe(&e))
    }
}
