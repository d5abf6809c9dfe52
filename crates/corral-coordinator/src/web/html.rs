//! HTML building blocks of the web view: escaping, the page frame (inline CSS, navigation, an
//! optional auto-refresh) and money.
//!
//! Invariant: every piece of text that came from a user or a worker (job names, commands,
//! reasons, log text, tenant and node names) goes through [`escape`] before it is written into
//! a page; only the fixed markup of this module and `pages.rs` is written raw.

use std::fmt::Write;

/// The text with `& < > " '` replaced by entities: safe in element content and in quoted
/// attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:0;color:#1d1d1f;background:#f6f7f9}\
header{background:#20303f;color:#fff;padding:.6em 1.2em;display:flex;gap:1.2em;align-items:center}\
header a{color:#fff;text-decoration:none;font-weight:600}header .who{margin-left:auto;font-size:.9em}\
header form{display:inline;margin:0}header button{font-size:.8em}\
main{padding:1em 1.2em}h1{font-size:1.4em;margin:.2em 0 .6em}h2{font-size:1.15em;margin:1.2em 0 .4em}\
table{border-collapse:collapse;background:#fff;margin-bottom:1em}\
th,td{border:1px solid #d5d9de;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#eef1f4}td.num{text-align:right}\
.banner{background:#fff4d6;border:1px solid #e0c26b;padding:.5em .8em;margin-bottom:1em}\
.error{background:#fde8e8;border:1px solid #e39b9b;padding:.5em .8em}\
.state-up,.state-running,.state-succeeded,.ok{color:#176f2c;font-weight:600}\
.state-down,.state-failed,.bad{color:#b3261e;font-weight:600}\
.state-cordoned,.state-draining,.state-drained,.state-pending,.warn{color:#9a6700;font-weight:600}\
.other{color:#777;font-style:italic}\
pre.log{background:#111;color:#e8e8e8;padding:.8em;overflow:auto;max-height:40em;white-space:pre-wrap}\
.totals span{display:inline-block;margin-right:1.5em}";

/// What every page shows around its body.
pub(crate) struct Frame<'a> {
    pub title: &'a str,
    /// Who is looking, e.g. "admin" or "tenant team-a"; `None` when the view is open.
    pub who: Option<&'a str>,
    /// A notice shown above the body (this coordinator is a follower, ...), as plain text.
    pub banner: Option<&'a str>,
    /// Reload the page every this many seconds.
    pub refresh_secs: Option<u32>,
}

/// A complete HTML document: `body` is markup built by the pages (already escaped).
pub(crate) fn page(frame: &Frame<'_>, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 4096);
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    if let Some(secs) = frame.refresh_secs {
        let _ = write!(out, "<meta http-equiv=\"refresh\" content=\"{secs}\">");
    }
    let _ = write!(out, "<title>{} - corral</title><style>{STYLE}</style></head><body>", escape(frame.title));
    out.push_str(
        "<header><a href=\"/\">corral</a><a href=\"/\">Pool</a><a href=\"/queue\">Queue</a>\
         <a href=\"/tenants\">Tenants</a>",
    );
    if let Some(who) = frame.who {
        let _ = write!(
            out,
            "<span class=\"who\">{} <form method=\"post\" action=\"/logout\"><button>log out</button></form></span>",
            escape(who)
        );
    }
    out.push_str("</header><main>");
    if let Some(banner) = frame.banner {
        let _ = write!(out, "<div class=\"banner\" id=\"banner\">{}</div>", escape(banner));
    }
    out.push_str(body);
    out.push_str("</main></body></html>\n");
    out
}

/// A money amount in micro-units, with the six decimals `corral billing report` prints.
pub(crate) fn money(micros: u64) -> String {
    format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_covers_markup_and_quotes() {
        assert_eq!(escape("<script>alert('x')</script>"), "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;");
        assert_eq!(escape("a & \"b\""), "a &amp; &quot;b&quot;");
        assert_eq!(escape("plain ü"), "plain ü");
    }

    #[test]
    fn the_frame_escapes_title_who_and_banner() {
        let frame = Frame { title: "<t>", who: Some("tenant <w>"), banner: Some("<b>"), refresh_secs: Some(5) };
        let html = page(&frame, "<p>body</p>");
        assert!(html.contains("<title>&lt;t&gt; - corral</title>"), "{html}");
        assert!(html.contains("tenant &lt;w&gt;") && html.contains("&lt;b&gt;</div>"), "{html}");
        assert!(html.contains("content=\"5\"") && html.contains("<p>body</p>"), "{html}");
        assert!(!html.contains("<t>") && !html.contains("<w>") && !html.contains("<b>"), "{html}");
    }

    #[test]
    fn money_has_six_decimals() {
        assert_eq!(money(890_000), "0.890000");
        assert_eq!(money(12_345_678), "12.345678");
    }
}
