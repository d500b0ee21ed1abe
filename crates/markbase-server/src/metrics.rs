//! Prometheus metrics (`GET /metrics`): requests, tokens, time to first token, inter-token
//! latency, and the engine's queue and KV-cache state.

use std::sync::OnceLock;
use std::time::Duration;

use markbase_engine::EngineStats;
use metrics::{counter, gauge, histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// HTTP requests answered, by route and status.
pub const HTTP_REQUESTS: &str = "markbase_http_requests_total";
/// Generation requests finished, by endpoint and finish reason.
pub const REQUESTS: &str = "markbase_requests_total";
/// Prompt tokens of submitted requests.
pub const PROMPT_TOKENS: &str = "markbase_prompt_tokens_total";
/// Generated tokens.
pub const GENERATED_TOKENS: &str = "markbase_generation_tokens_total";
/// Time from a request's arrival to its first token.
pub const TTFT: &str = "markbase_time_to_first_token_seconds";
/// Time between consecutive tokens of a request.
pub const ITL: &str = "markbase_inter_token_latency_seconds";
/// Time from a request's arrival to its end.
pub const E2E: &str = "markbase_request_duration_seconds";
/// Requests waiting for the engine.
pub const QUEUE_DEPTH: &str = "markbase_queue_depth";
/// Sequences the engine runs.
pub const RUNNING: &str = "markbase_running_sequences";
/// KV blocks in use.
pub const KV_USED: &str = "markbase_kv_blocks_used";
/// KV blocks in the pool.
pub const KV_TOTAL: &str = "markbase_kv_blocks_total";
/// Sequences preempted (recomputed later) since start.
pub const PREEMPTIONS: &str = "markbase_preemptions_total";
/// Prompt tokens served from the prefix cache since start.
pub const PREFIX_HITS: &str = "markbase_prefix_cache_hit_tokens_total";
/// Engine steps run since start.
pub const STEPS: &str = "markbase_engine_steps_total";
/// Token rows the engine's steps ran since start, by kind (decode, prefill).
pub const STEP_ROWS: &str = "markbase_engine_step_rows_total";
/// Seconds the engine spent in steps since start.
pub const STEP_SECONDS: &str = "markbase_engine_step_seconds";
/// Seconds of those the host waited for the model's device.
pub const DEVICE_WAIT_SECONDS: &str = "markbase_engine_device_wait_seconds";
/// Times the host waited for the model's device since start.
pub const DEVICE_WAITS: &str = "markbase_engine_device_waits_total";
/// Engine steps that ran as one CUDA graph replay since start.
pub const GRAPH_REPLAYS: &str = "markbase_engine_graph_replays_total";
/// Device bytes held by f16 copies of the model's quantized weights.
pub const F16_COPY_BYTES: &str = "markbase_f16_copy_bytes";

const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
const REQUEST_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];

/// The process-wide recorder (installed on first use; later servers in the process share it).
pub fn handle() -> Result<PrometheusHandle, String> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(TTFT.into()), &LATENCY_BUCKETS)
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(ITL.into()), &LATENCY_BUCKETS))
                .and_then(|b| b.set_buckets_for_metric(Matcher::Full(E2E.into()), &REQUEST_BUCKETS))
                .and_then(|b| b.install_recorder())
                .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
            describe();
            Ok(handle)
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(HTTP_REQUESTS, "HTTP requests answered, by route and status");
    describe_counter!(
        REQUESTS,
        "Generation requests finished, by endpoint and finish reason"
    );
    describe_counter!(
        PROMPT_TOKENS,
        Unit::Count,
        "Prompt tokens of submitted requests"
    );
    describe_counter!(GENERATED_TOKENS, Unit::Count, "Generated tokens");
    describe_histogram!(
        TTFT,
        Unit::Seconds,
        "Time from a request's arrival to its first token"
    );
    describe_histogram!(
        ITL,
        Unit::Seconds,
        "Time between consecutive tokens of a request"
    );
    describe_histogram!(
        E2E,
        Unit::Seconds,
        "Time from a request's arrival to its end"
    );
    describe_gauge!(QUEUE_DEPTH, "Requests waiting for the engine");
    describe_gauge!(RUNNING, "Sequences the engine is running");
    describe_gauge!(KV_USED, "KV-cache blocks in use");
    describe_gauge!(KV_TOTAL, "KV-cache blocks in the pool");
    describe_counter!(PREEMPTIONS, "Sequences preempted since start");
    describe_counter!(
        PREFIX_HITS,
        "Prompt tokens served from the prefix cache since start"
    );
    describe_counter!(STEPS, "Engine steps run since start");
    describe_counter!(
        STEP_ROWS,
        Unit::Count,
        "Token rows the engine's steps ran since start, by kind"
    );
    describe_gauge!(
        STEP_SECONDS,
        Unit::Seconds,
        "Seconds the engine spent in steps since start"
    );
    describe_counter!(
        DEVICE_WAITS,
        "Times the host waited for the model's device since start"
    );
    describe_counter!(
        GRAPH_REPLAYS,
        "Engine steps that ran as one CUDA graph replay since start"
    );
    describe_gauge!(
        F16_COPY_BYTES,
        Unit::Bytes,
        "Device bytes held by f16 copies of the model's quantized weights"
    );
    describe_gauge!(
        DEVICE_WAIT_SECONDS,
        Unit::Seconds,
        "Seconds of the engine's steps the host waited for the model's device"
    );
}

/// Records an answered HTTP request.
pub fn http_request(route: &str, status: u16) {
    counter!(HTTP_REQUESTS, "route" => route.to_string(), "status" => status.to_string())
        .increment(1);
}

/// Records a submitted request's prompt.
pub fn submitted(prompt_tokens: usize) {
    counter!(PROMPT_TOKENS).increment(prompt_tokens as u64);
}

/// Records a generated token: its delay after the request's arrival (first token) or after
/// the previous token.
pub fn token(first: bool, delay: Duration) {
    counter!(GENERATED_TOKENS).increment(1);
    histogram!(if first { TTFT } else { ITL }).record(delay.as_secs_f64());
}

/// Records a finished generation.
pub fn finished(endpoint: &'static str, finish_reason: &'static str, duration: Duration) {
    counter!(REQUESTS, "endpoint" => endpoint, "finish_reason" => finish_reason).increment(1);
    histogram!(E2E).record(duration.as_secs_f64());
}

/// Publishes an engine snapshot.
pub fn engine(stats: &EngineStats) {
    gauge!(QUEUE_DEPTH).set(stats.waiting as f64);
    gauge!(RUNNING).set(stats.running as f64);
    gauge!(KV_USED).set(stats.kv_blocks_used as f64);
    gauge!(KV_TOTAL).set(stats.kv_blocks_total as f64);
    counter!(PREEMPTIONS).absolute(stats.preemptions);
    counter!(PREFIX_HITS).absolute(stats.prefix_cache_hit_tokens);
    counter!(STEPS).absolute(stats.steps);
    counter!(STEP_ROWS, "kind" => "decode").absolute(stats.decode_rows);
    counter!(STEP_ROWS, "kind" => "prefill").absolute(stats.prefill_rows);
    gauge!(STEP_SECONDS).set(stats.step_seconds);
    gauge!(DEVICE_WAIT_SECONDS).set(stats.device_wait_seconds);
    counter!(DEVICE_WAITS).absolute(stats.device_waits);
    counter!(GRAPH_REPLAYS).absolute(stats.graph_replays);
    gauge!(F16_COPY_BYTES).set(stats.f16_copy_bytes as f64);
}
