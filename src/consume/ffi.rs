//! Every call into librdkafka's C API that rdkafka does not wrap, each behind a small safe
//! function.
//!
//! # Safety
//!
//! Each function takes the consumer by reference, so its handle (`native_ptr`) is live for the
//! call. A queue handle obtained from librdkafka is a new reference: [`PartitionFeed`] owns the
//! one of its partition and releases it exactly once on drop; the consumer's queue taken for an
//! asynchronous commit is released right after the call. A message taken from a queue is read
//! (its key and value copied out) and destroyed exactly once, before the function returns, so no
//! pointer into librdkafka's memory outlives the call. librdkafka's queues are thread-safe; the
//! poll thread uses a feed only under the consumer context's lock, and every feed is dropped
//! before the consumer is destroyed (the lanes are stopped and the feeds cleared first).

use super::RawMessage;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, KafkaResult};
use std::ffi::CStr;

/// One assigned partition's own queue in librdkafka, split off the consumer's queue when the
/// partition is assigned. The poll loop takes its messages only while the partition's lane has
/// room; otherwise they stay here, where librdkafka stops fetching past
/// `queued.max.messages.kbytes`. (Pausing the partition instead would make librdkafka drop what
/// it pre-fetched and fetch it again on resume.) The split is what rdkafka's
/// `split_partition_queue` does, but that needs the consumer in an `Arc`, and the split must
/// happen in the rebalance callback, before the partition's first fetch, where there is none.
pub(super) struct PartitionFeed(*mut rdkafka::bindings::rd_kafka_queue_t);

// SAFETY: librdkafka's queues are thread-safe; the handle is used only under the context's lock
// and released before the consumer is destroyed (`leave` stops every lane first).
unsafe impl Send for PartitionFeed {}

impl PartitionFeed {
    /// Splits `partition`'s queue off the consumer's: librdkafka keeps it split across later
    /// fetch restarts, because the application set it.
    pub(super) fn split<C: ConsumerContext>(
        consumer: &BaseConsumer<C>,
        topic: &CStr,
        partition: i32,
    ) -> Option<Self> {
        use rdkafka::bindings as rd;
        let rk = consumer.client().native_ptr();
        // SAFETY: `rk` is the live consumer; the queue returned is a new reference we own.
        unsafe {
            let queue = rd::rd_kafka_queue_get_partition(rk, topic.as_ptr(), partition);
            if queue.is_null() {
                return None;
            }
            rd::rd_kafka_queue_forward(queue, std::ptr::null_mut());
            Some(Self(queue))
        }
    }

    /// The next message waiting, its bytes copied out, or the error it carries; never waits.
    pub(super) fn next(&self) -> Option<KafkaResult<RawMessage>> {
        use rdkafka::bindings as rd;
        // SAFETY: the queue is ours until drop; a message returned is read, then destroyed once.
        unsafe {
            let message = rd::rd_kafka_consume_queue(self.0, 0);
            if message.is_null() {
                return None;
            }
            let m = &*message;
            let copy = |ptr: *mut std::ffi::c_void, len: usize| {
                (!ptr.is_null()).then(|| std::slice::from_raw_parts(ptr as *const u8, len).to_vec())
            };
            let result = if m.err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                let (headers, traceparent) = headers_and_trace(message);
                Ok(RawMessage {
                    offset: m.offset,
                    key: copy(m.key, m.key_len),
                    value: copy(m.payload, m.len),
                    traceparent,
                    headers,
                })
            } else {
                Err(KafkaError::MessageConsumption(m.err.into()))
            };
            rd::rd_kafka_message_destroy(message);
            Some(result)
        }
    }
}

/// The message's headers, in order, and the last `traceparent` among them when it is UTF-8.
///
/// # Safety
/// `message` is a live message of librdkafka's.
pub(super) unsafe fn headers_and_trace(
    message: *mut rdkafka::bindings::rd_kafka_message_t,
) -> (crate::inputs::Headers, Option<String>) {
    let headers = headers(message);
    let traceparent = headers
        .last("traceparent")
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_owned);
    (headers, traceparent)
}

/// Every header of the message, in order.
///
/// # Safety
/// `message` is a live message of librdkafka's.
unsafe fn headers(message: *mut rdkafka::bindings::rd_kafka_message_t) -> crate::inputs::Headers {
    use rdkafka::bindings as rd;
    let mut all = crate::inputs::Headers::new();
    let mut headers: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
    if rd::rd_kafka_message_headers(message, &mut headers)
        != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
    {
        return all;
    }
    let mut index = 0;
    loop {
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let mut value: *const std::ffi::c_void = std::ptr::null();
        let mut size: usize = 0;
        if rd::rd_kafka_header_get_all(headers, index, &mut name, &mut value, &mut size)
            != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        {
            return all;
        }
        let name = std::ffi::CStr::from_ptr(name).to_string_lossy();
        let value = (!value.is_null())
            .then(|| std::slice::from_raw_parts(value as *const u8, size).to_vec());
        all.push(name, value);
        index += 1;
    }
}

impl Drop for PartitionFeed {
    fn drop(&mut self) {
        // SAFETY: releases the reference taken in `split`, once.
        unsafe { rdkafka::bindings::rd_kafka_queue_destroy(self.0) }
    }
}

/// Commits the stored offsets without waiting, the outcome reported to
/// [`ConsumerContext::commit_callback`] by a later poll. (`commit_consumer_state(Async)` posts
/// its outcome nowhere when the consumer uses librdkafka's event API: a failure would be only
/// logged, and never retried.) False when the commit could not even be started.
pub(super) fn commit_async<C: ConsumerContext>(consumer: &BaseConsumer<C>) -> bool {
    use rdkafka::bindings as rd;
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is this live consumer's handle. The consumer queue is a new reference that is
    // released right after the call; a null offsets list means the stored offsets, and without a
    // callback the outcome is posted as an event on that queue, which `poll` serves.
    let err = unsafe {
        let queue = rd::rd_kafka_queue_get_consumer(rk);
        if queue.is_null() {
            return false;
        }
        let err =
            rd::rd_kafka_commit_queue(rk, std::ptr::null(), queue, None, std::ptr::null_mut());
        rd::rd_kafka_queue_destroy(queue);
        err
    };
    match err {
        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        | rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__NO_OFFSET => true,
        e => {
            let e = KafkaError::ConsumerCommit(e.into());
            tracing::warn!(error = %e, "An offset commit could not be started; retrying it.");
            false
        }
    }
}
