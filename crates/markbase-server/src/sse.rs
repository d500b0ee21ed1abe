//! Server-sent events: each reply update becomes zero or more `data: JSON` events, and the
//! stream ends with `data: [DONE]`, as OpenAI streams do.

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, StreamExt};
use tokio::sync::mpsc;

use crate::generate::Update;

/// A streaming response: `convert` turns each update into the JSON texts of its events (an
/// error update into an error body); after the last update comes `[DONE]`.
pub fn stream<F>(rx: mpsc::Receiver<Update>, convert: F) -> Response
where
    F: FnMut(Update) -> Vec<String> + Send + 'static,
{
    let events = stream::unfold((rx, convert), |(mut rx, mut convert)| async move {
        let update = rx.recv().await?;
        let datas = convert(update);
        Some((stream::iter(datas), (rx, convert)))
    })
    .flatten()
    .chain(stream::once(async { "[DONE]".to_string() }))
    .map(|data| Ok::<_, Infallible>(Event::default().data(data)));
    Sse::new(events).into_response()
}
