//! A minimal HTTP/1 client for `bench-serve`: one streaming chat completion, timed chunk by
//! chunk (server-sent events read as they arrive).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A shared client (keeps connections alive between requests).
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A new client.
pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The timing of one streamed reply.
#[derive(Clone, Debug)]
pub struct Timing {
    /// From sending the request to the first chunk with text.
    pub ttft: Duration,
    /// Gaps between consecutive chunks with text.
    pub gaps: Vec<Duration>,
    /// From sending the request to the end of the stream.
    pub total: Duration,
    /// Generated tokens (the usage the server reported).
    pub completion_tokens: usize,
}

/// Sends `body` to `url` (`…/v1/chat/completions`, `stream` and `include_usage` set) and times
/// the reply.
pub async fn stream_chat(
    client: &HttpClient,
    url: &hyper::Uri,
    api_key: Option<&str>,
    body: &serde_json::Value,
) -> Result<Timing> {
    let mut req = Request::post(url.clone()).header("content-type", "application/json");
    if let Some(k) = api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = req.body(Full::new(Bytes::from(body.to_string())))?;
    let t0 = Instant::now();
    let resp = client
        .request(req)
        .await
        .with_context(|| format!("cannot reach {url}"))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        bail!("{url}: HTTP {status}: {}", String::from_utf8_lossy(&bytes));
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut first: Option<Instant> = None;
    let mut last = t0;
    let mut gaps = Vec::new();
    let mut completion_tokens = None;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = frame.context("the stream broke")?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.extend_from_slice(data);
        let now = Instant::now();
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(payload) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if payload == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(payload)
                    .with_context(|| format!("bad event from the server: {payload}"))?;
                if let Some(e) = v.get("error") {
                    bail!("the server reported an error: {e}");
                }
                if let Some(n) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(|n| n.as_u64())
                {
                    completion_tokens = Some(n as usize);
                }
                let delta = v.pointer("/choices/0/delta");
                let has_text = ["content", "reasoning_content"].iter().any(|k| {
                    delta
                        .and_then(|d| d.get(k))
                        .and_then(|c| c.as_str())
                        .is_some_and(|c| !c.is_empty())
                });
                if has_text {
                    match first {
                        None => first = Some(now),
                        Some(_) => gaps.push(now - last),
                    }
                    last = now;
                }
            }
        }
    }
    if !done {
        bail!("the stream ended without [DONE]");
    }
    Ok(Timing {
        ttft: first.unwrap_or(last) - t0,
        gaps,
        total: t0.elapsed(),
        completion_tokens: completion_tokens.context("the stream carried no usage")?,
    })
}

/// `GET url` as JSON (the body of a 2xx answer).
pub async fn get_json(
    client: &HttpClient,
    url: &hyper::Uri,
    api_key: Option<&str>,
) -> Result<serde_json::Value> {
    let mut req = Request::get(url.clone());
    if let Some(k) = api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = client
        .request(req.body(Full::new(Bytes::new()))?)
        .await
        .with_context(|| format!("cannot reach {url}"))?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{url}: HTTP {status}: {}", String::from_utf8_lossy(&bytes));
    }
    serde_json::from_slice(&bytes).with_context(|| format!("{url}: the answer is not JSON"))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
