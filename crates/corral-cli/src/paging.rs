//! Paged listings on the command line: follow the pages of a listing (all of them, or up to
//! `--limit`), and tell the user how to continue where a limit stopped.

use corral_client::{ClientError, Page};
use std::future::Future;

/// Largest page asked for at once (the servers cap pages at this size too).
const MAX_PAGE: u32 = 10_000;

/// Fetches pages with `fetch(page token, limit)` from `start` (empty: the first) and hands
/// each page's items to `sink` as it arrives, until the listing ends or `limit` items came.
/// Returns the token of the next page when the limit stopped it before the end.
pub async fn follow<T, F, Fut>(
    start: Option<String>,
    limit: Option<u32>,
    mut fetch: F,
    mut sink: impl FnMut(Vec<T>) -> anyhow::Result<()>,
) -> anyhow::Result<Option<String>>
where
    F: FnMut(String, u32) -> Fut,
    Fut: Future<Output = Result<Page<T>, ClientError>>,
{
    let mut token = start.unwrap_or_default();
    let mut left = limit;
    loop {
        let want = left.map_or(0, |n| n.min(MAX_PAGE));
        let page = fetch(token, want).await?;
        if let Some(n) = &mut left {
            *n = n.saturating_sub(page.items.len() as u32);
        }
        sink(page.items)?;
        match page.next_page_token {
            None => return Ok(None),
            Some(next) if left == Some(0) => return Ok(Some(next)),
            Some(next) => token = next,
        }
    }
}

/// The stderr line after a table that `--limit` cut short.
pub fn more_hint(what: &str, next: &str) {
    eprintln!("more {what} follow: add --page-token {next} to list the next ones");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing of `total` numbers served `server_page` at a time at most.
    fn server(
        total: u32,
        server_page: u32,
    ) -> impl FnMut(String, u32) -> std::future::Ready<Result<Page<u32>, ClientError>> {
        move |token: String, limit: u32| {
            let from: u32 = if token.is_empty() { 0 } else { token.parse().expect("token") };
            let size = if limit == 0 { server_page } else { limit.min(server_page) };
            let to = (from + size).min(total);
            let next = (to < total).then(|| to.to_string());
            std::future::ready(Ok(Page { items: (from..to).collect(), next_page_token: next }))
        }
    }

    #[tokio::test]
    async fn without_a_limit_every_page_is_followed() {
        let mut seen = Vec::new();
        let mut pages = 0;
        let next = follow(None, None, server(25, 10), |items| {
            pages += 1;
            seen.extend(items);
            Ok(())
        })
        .await
        .expect("follow");
        assert_eq!(next, None);
        assert_eq!(seen, (0..25).collect::<Vec<_>>());
        assert_eq!(pages, 3, "rows are handed on page by page");
    }

    #[tokio::test]
    async fn a_limit_stops_after_that_many_and_gives_the_next_token() {
        let mut seen = Vec::new();
        // The server pages by 10: a limit of 15 takes two calls.
        let next = follow(None, Some(15), server(25, 10), |items| {
            seen.extend(items);
            Ok(())
        })
        .await
        .expect("follow");
        assert_eq!(seen, (0..15).collect::<Vec<_>>());
        assert_eq!(next.as_deref(), Some("15"));
        let mut rest = Vec::new();
        let end = follow(next, Some(100), server(25, 10), |items| {
            rest.extend(items);
            Ok(())
        })
        .await
        .expect("follow");
        assert_eq!(rest, (15..25).collect::<Vec<_>>());
        assert_eq!(end, None, "the listing ended before the limit");
    }
}
