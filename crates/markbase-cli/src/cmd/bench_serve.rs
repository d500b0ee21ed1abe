//! `markbase bench-serve URL`: a load generator for a running server. At each concurrency
//! level it keeps N streaming chat requests in flight and reports aggregate output tokens per
//! second, time to first token and inter-token latency percentiles; from a markbase server it
//! also reports what the engine's steps did meanwhile (`GET /health`'s step counters).

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::cmd::sse_client::{self, Timing};

/// Arguments of `bench-serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The server's base URL (http only).
    #[arg(default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Concurrency levels, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub concurrency: Vec<usize>,
    /// Requests per level (default: 4 × concurrency, at least 8).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Tokens each reply generates (end-of-turn ignored so every reply has this length).
    #[arg(long = "max-tokens", default_value_t = 64)]
    pub max_tokens: usize,
    /// The user message.
    #[arg(long, default_value = "Write a short story about a lighthouse keeper.")]
    pub prompt: String,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability (sent only when
    /// given).
    #[arg(long = "top-p")]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (sent only when given).
    #[arg(long = "top-k")]
    pub top_k: Option<usize>,
    /// Stop at end-of-turn instead of always generating max-tokens.
    #[arg(long = "allow-eos")]
    pub allow_eos: bool,
    /// API key (also MARKBASE_API_KEY).
    #[arg(long = "api-key", env = "MARKBASE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Give up on a request after this many seconds.
    #[arg(long = "timeout", default_value_t = 600)]
    pub timeout_s: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The results of one concurrency level.
struct Level {
    concurrency: usize,
    requests: usize,
    tokens: usize,
    wall: Duration,
    ttft: Vec<Duration>,
    itl: Vec<Duration>,
    e2e: Vec<Duration>,
    /// The engine's steps during the level (a markbase server only).
    engine: Option<EngineCounters>,
}

/// A markbase server's step counters (`GET /health`), or their change over a level.
#[derive(Clone, Copy, Debug)]
struct EngineCounters {
    steps: f64,
    decode_rows: f64,
    prefill_rows: f64,
    step_seconds: f64,
    device_wait_seconds: f64,
    device_waits: f64,
    graph_replays: f64,
}

impl EngineCounters {
    /// The counters in a `/health` answer; `None` from a server without them.
    fn from_health(v: &serde_json::Value) -> Option<Self> {
        let f = |k: &str| v.get(k).and_then(|x| x.as_f64());
        Some(EngineCounters {
            steps: f("steps")?,
            decode_rows: f("decode_rows")?,
            prefill_rows: f("prefill_rows")?,
            step_seconds: f("step_seconds")?,
            device_wait_seconds: f("device_wait_seconds")?,
            device_waits: f("device_waits")?,
            graph_replays: f("graph_replays")?,
        })
    }

    /// What changed from `before` to `self`.
    fn since(&self, before: &Self) -> Self {
        EngineCounters {
            steps: self.steps - before.steps,
            decode_rows: self.decode_rows - before.decode_rows,
            prefill_rows: self.prefill_rows - before.prefill_rows,
            step_seconds: self.step_seconds - before.step_seconds,
            device_wait_seconds: self.device_wait_seconds - before.device_wait_seconds,
            device_waits: self.device_waits - before.device_waits,
            graph_replays: self.graph_replays - before.graph_replays,
        }
    }

    /// The counters a step, and the shares of `wall` and of the steps' time.
    fn summary(&self, wall: Duration) -> StepSummary {
        let per = |x: f64| x / self.steps.max(1.0);
        StepSummary {
            steps: self.steps,
            decode_rows: per(self.decode_rows),
            prefill_rows: per(self.prefill_rows),
            ms: per(self.step_seconds) * 1e3,
            device_waits: per(self.device_waits),
            graph_replays: per(self.graph_replays),
            busy_share: self.step_seconds / wall.as_secs_f64(),
            device_wait_share: self.device_wait_seconds / self.step_seconds.max(1e-12),
        }
    }
}

/// What the engine's steps did during a level: per step, decode rows, prefill rows,
/// milliseconds, device waits and graph replays; the share of the level in steps and of the
/// steps' time the host waited for the device.
struct StepSummary {
    steps: f64,
    decode_rows: f64,
    prefill_rows: f64,
    ms: f64,
    device_waits: f64,
    graph_replays: f64,
    busy_share: f64,
    device_wait_share: f64,
}

impl StepSummary {
    fn to_json(&self) -> serde_json::Value {
        json!({
            "steps": self.steps,
            "decode_rows_per_step": self.decode_rows,
            "prefill_rows_per_step": self.prefill_rows,
            "ms_per_step": self.ms,
            "device_waits_per_step": self.device_waits,
            "graph_replays_per_step": self.graph_replays,
            "busy_share": self.busy_share,
            "device_wait_share": self.device_wait_share,
        })
    }
}

/// The server's step counters now, if it reports them.
async fn engine_counters(
    client: &sse_client::HttpClient,
    health: &hyper::Uri,
) -> Option<EngineCounters> {
    let v = sse_client::get_json(client, health, None).await.ok()?;
    EngineCounters::from_health(&v)
}

/// The `p`-th percentile (nearest rank) in milliseconds.
fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1e3
}

impl Level {
    fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64()
    }

    fn to_json(&self) -> serde_json::Value {
        let p =
            |v: &[Duration]| json!({"p50": pct(v, 50.0), "p90": pct(v, 90.0), "p99": pct(v, 99.0)});
        json!({
            "concurrency": self.concurrency,
            "requests": self.requests,
            "completion_tokens": self.tokens,
            "wall_s": self.wall.as_secs_f64(),
            "output_tokens_per_second": self.tokens_per_second(),
            "requests_per_second": self.requests as f64 / self.wall.as_secs_f64(),
            "ttft_ms": p(&self.ttft),
            "itl_ms": p(&self.itl),
            "e2e_ms": p(&self.e2e),
            "engine": self.engine.map(|e| e.summary(self.wall).to_json()),
        })
    }
}

/// Runs `bench-serve`.
pub fn run(args: Args) -> Result<()> {
    if args.concurrency.contains(&0) {
        bail!("--concurrency levels must be at least 1");
    }
    let base = args.url.trim_end_matches('/');
    if !base.starts_with("http://") {
        bail!("bench-serve speaks plain http; {base} is not an http:// URL");
    }
    let url: hyper::Uri = format!("{base}/v1/chat/completions")
        .parse()
        .with_context(|| format!("bad URL {base}"))?;
    let health: hyper::Uri = format!("{base}/health")
        .parse()
        .with_context(|| format!("bad URL {base}"))?;
    let mut body = json!({
        "model": "markbase",
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": !args.allow_eos,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(p) = args.top_p {
        body["top_p"] = json!(p);
    }
    if let Some(k) = args.top_k {
        body["top_k"] = json!(k);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let timeout = Duration::from_secs(args.timeout_s);
    let levels = runtime.block_on(async {
        let client = sse_client::client();
        // One request first: connections open, the server's first-use costs paid.
        tokio::time::timeout(
            timeout,
            sse_client::stream_chat(&client, &url, args.api_key.as_deref(), &body),
        )
        .await
        .context("the warm-up request timed out")??;
        if !args.json {
            let mut o = std::io::stdout().lock();
            writeln!(
                o,
                "| concurrency | requests | tokens | wall s | output t/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms |"
            )?;
            writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")?;
        }
        let mut levels = Vec::new();
        for &c in &args.concurrency {
            let n = args.requests.unwrap_or((4 * c).max(8)).max(c);
            let before = engine_counters(&client, &health).await;
            let mut level =
                run_level(&client, &url, args.api_key.as_deref(), &body, c, n, timeout).await?;
            let after = engine_counters(&client, &health).await;
            level.engine = after.zip(before).map(|(a, b)| a.since(&b));
            if !args.json {
                let ms = |v: &[Duration]| {
                    format!(
                        "{:.0} / {:.0} / {:.0}",
                        pct(v, 50.0),
                        pct(v, 90.0),
                        pct(v, 99.0)
                    )
                };
                let ms1 = |v: &[Duration]| {
                    format!(
                        "{:.1} / {:.1} / {:.1}",
                        pct(v, 50.0),
                        pct(v, 90.0),
                        pct(v, 99.0)
                    )
                };
                let mut o = std::io::stdout().lock();
                writeln!(
                    o,
                    "| {} | {} | {} | {:.2} | {:.1} | {} | {} |",
                    level.concurrency,
                    level.requests,
                    level.tokens,
                    level.wall.as_secs_f64(),
                    level.tokens_per_second(),
                    ms(&level.ttft),
                    ms1(&level.itl)
                )?;
            }
            levels.push(level);
        }
        anyhow::Ok(levels)
    })?;
    let mut out = std::io::stdout().lock();
    if args.json {
        let obj = json!({
            "url": base,
            "max_tokens": args.max_tokens,
            "levels": levels.iter().map(Level::to_json).collect::<Vec<_>>(),
        });
        writeln!(out, "{obj}")?;
        return Ok(());
    }
    if levels.iter().any(|l| l.engine.is_some()) {
        writeln!(out, "\nthe engine's steps during each level:\n")?;
        writeln!(
            out,
            "| concurrency | steps | decode rows / step | prefill rows / step | ms / step | in steps | waiting for the device | device waits / step | graph replays / step |"
        )?;
        writeln!(
            out,
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        )?;
        for l in &levels {
            let Some(e) = l.engine else { continue };
            let s = e.summary(l.wall);
            writeln!(
                out,
                "| {} | {} | {:.1} | {:.1} | {:.2} | {:.0} % | {:.0} % | {:.2} | {:.2} |",
                l.concurrency,
                s.steps,
                s.decode_rows,
                s.prefill_rows,
                s.ms,
                100.0 * s.busy_share,
                100.0 * s.device_wait_share,
                s.device_waits,
                s.graph_replays,
            )?;
        }
    }
    if let (Some(one), Some(most)) = (
        levels.iter().find(|l| l.concurrency == 1),
        levels.iter().max_by_key(|l| l.concurrency),
    ) {
        if most.concurrency > 1 {
            writeln!(
                out,
                "aggregate speed-up at concurrency {}: {:.2}x of concurrency 1",
                most.concurrency,
                most.tokens_per_second() / one.tokens_per_second()
            )?;
        }
    }
    Ok(())
}

/// Keeps `c` requests in flight until `n` have finished.
async fn run_level(
    client: &sse_client::HttpClient,
    url: &hyper::Uri,
    api_key: Option<&str>,
    body: &serde_json::Value,
    c: usize,
    n: usize,
    timeout: Duration,
) -> Result<Level> {
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..c {
        let (client, url, body, next) = (client.clone(), url.clone(), body.clone(), next.clone());
        let key = api_key.map(str::to_string);
        workers.push(tokio::spawn(async move {
            let mut timings: Vec<Timing> = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let t = tokio::time::timeout(
                    timeout,
                    sse_client::stream_chat(&client, &url, key.as_deref(), &body),
                )
                .await
                .context("a request timed out")??;
                timings.push(t);
            }
            anyhow::Ok(timings)
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await.context("a worker failed")??);
    }
    let wall = t0.elapsed();
    let mut level = Level {
        concurrency: c,
        requests: all.len(),
        tokens: all.iter().map(|t| t.completion_tokens).sum(),
        wall,
        ttft: all.iter().map(|t| t.ttft).collect(),
        itl: all.iter().flat_map(|t| t.gaps.iter().copied()).collect(),
        e2e: all.iter().map(|t| t.total).collect(),
        engine: None,
    };
    level.ttft.sort();
    level.itl.sort();
    level.e2e.sort();
    Ok(level)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<Duration> = (1..=10).map(Duration::from_millis).collect();
        assert_eq!(pct(&v, 50.0), 5.0);
        assert_eq!(pct(&v, 90.0), 9.0);
        assert_eq!(pct(&v, 99.0), 10.0);
        assert_eq!(pct(&v[..1], 50.0), 1.0);
        assert!(pct(&[], 50.0).is_nan());
    }
}
