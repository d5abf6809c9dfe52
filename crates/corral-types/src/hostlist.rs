//! Slurm's hostlist syntax: `gpu-[01-04,07],login1` stands for gpu-01 … gpu-04, gpu-07 and
//! login1. `compress` writes a list of names the way Slurm writes `SLURM_JOB_NODELIST`
//! (`scontrol show hostlist`), `expand` reads one back (`scontrol show hostnames`).
//!
//! Both follow Slurm 22.05 as observed with `scontrol`: compression keeps the order of the names
//! (the allocation's first node stays first, so `scontrol show hostnames | head -n 1` is the
//! batch node) and only merges neighbours sharing a prefix; a number's width is kept
//! (`n[08-10]`, but `n[9-10,08]`); a duplicate stays a duplicate. Expansion takes several
//! bracket groups (`r[1-2]n[01-02]`, the first one varying slowest) and text after them (which Slurm 22.05
//! refuses).
//!
//! Cost: `expand` refuses a list of more than [`MAX_HOSTS`] names before building it, so its
//! work is bounded whatever the input.

use std::fmt::Write as _;

/// Most names one hostlist may expand to.
pub const MAX_HOSTS: usize = 65_536;

/// Why a hostlist could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid hostlist '{list}': {reason}")]
pub struct HostlistError {
    pub list: String,
    pub reason: String,
}

/// A host name split at its trailing digits: `gpu-07` is (`gpu-`, `07`).
fn split_number(host: &str) -> (&str, Option<&str>) {
    let digits = host.bytes().rev().take_while(u8::is_ascii_digit).count();
    if digits == 0 || digits > 18 {
        return (host, None);
    }
    let (prefix, number) = host.split_at(host.len() - digits);
    (prefix, Some(number))
}

/// A run of numbers written alike: `lo`..=`hi`, zero-padded to `width` digits (0: not padded).
#[derive(Debug, Clone, Copy)]
struct Run {
    lo: u64,
    hi: u64,
    width: usize,
}

/// How `digits` is written: its width when zero-padded (`07` is 2), else 0.
fn padding(digits: &str) -> usize {
    if digits.len() > 1 && digits.starts_with('0') {
        digits.len()
    } else {
        0
    }
}

impl Run {
    fn of(digits: &str) -> Run {
        let n = digits.parse().unwrap_or(0);
        Run { lo: n, hi: n, width: padding(digits) }
    }

    /// Takes the next number if it continues the run in the same writing.
    fn extend(&mut self, digits: &str) -> bool {
        let n: u64 = digits.parse().unwrap_or(0);
        let same_writing = match self.width {
            0 => padding(digits) == 0,
            width => digits.len() == width,
        };
        if same_writing && Some(n) == self.hi.checked_add(1) {
            self.hi = n;
            return true;
        }
        false
    }

    fn write(&self, out: &mut String) {
        let width = self.width;
        let _ = write!(out, "{:0width$}", self.lo);
        if self.hi != self.lo {
            let _ = write!(out, "-{:0width$}", self.hi);
        }
    }
}

/// Slurm's compressed form of `hosts`, in their order: `gpu-[01-03,07],login1`.
pub fn compress<S: AsRef<str>>(hosts: &[S]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < hosts.len() {
        let (prefix, number) = split_number(hosts[i].as_ref());
        let Some(first) = number else {
            push_item(&mut out, hosts[i].as_ref());
            i += 1;
            continue;
        };
        // The neighbours with the same prefix and a number form one bracket group.
        let mut runs = vec![Run::of(first)];
        let mut j = i + 1;
        while let Some(next) = hosts.get(j) {
            match split_number(next.as_ref()) {
                (p, Some(digits)) if p == prefix => {
                    let last = runs.last_mut().expect("one run at least");
                    if !last.extend(digits) {
                        runs.push(Run::of(digits));
                    }
                    j += 1;
                }
                _ => break,
            }
        }
        if j == i + 1 {
            push_item(&mut out, hosts[i].as_ref());
        } else {
            let mut group = format!("{prefix}[");
            for (k, run) in runs.iter().enumerate() {
                if k > 0 {
                    group.push(',');
                }
                run.write(&mut group);
            }
            group.push(']');
            push_item(&mut out, &group);
        }
        i = j;
    }
    out
}

fn push_item(out: &mut String, item: &str) {
    if !out.is_empty() {
        out.push(',');
    }
    out.push_str(item);
}

/// The names of a hostlist, in order: `gpu-[01-02],login1` gives gpu-01, gpu-02, login1.
/// Blanks around items are ignored; an empty list has no names.
pub fn expand(list: &str) -> Result<Vec<String>, HostlistError> {
    let fail = |reason: String| HostlistError { list: list.to_string(), reason };
    let mut hosts = Vec::new();
    for item in split_top_level(list).map_err(&fail)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let pieces = parse_item(item).map_err(&fail)?;
        let count = pieces.iter().try_fold(1usize, |n, p| n.checked_mul(p.len()).filter(|n| *n <= MAX_HOSTS));
        match count {
            Some(n) if hosts.len() + n <= MAX_HOSTS => product(&pieces, &mut String::new(), &mut hosts),
            _ => return Err(fail(format!("more than {MAX_HOSTS} names"))),
        }
    }
    Ok(hosts)
}

/// The items of a list: split at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("brackets inside brackets".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("a ']' without its '['".into()),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' without its ']'".into());
    }
    items.push(&list[start..]);
    Ok(items)
}

/// One piece of an item: fixed text, or the choices of a bracket group.
enum Piece {
    Text(String),
    Choices(Vec<String>),
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Text(_) => 1,
            Piece::Choices(c) => c.len(),
        }
    }
}

fn parse_item(item: &str) -> Result<Vec<Piece>, String> {
    let mut pieces = Vec::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            pieces.push(Piece::Text(rest[..open].to_string()));
        }
        let close = rest[open..].find(']').map(|c| open + c).ok_or("a '[' without its ']'")?;
        pieces.push(Piece::Choices(parse_ranges(&rest[open + 1..close])?));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest.to_string()));
    }
    Ok(pieces)
}

/// `01-03,7` gives 01, 02, 03, 7: each range keeps the width of its first number.
fn parse_ranges(ranges: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for range in ranges.split(',') {
        let range = range.trim();
        let number = |s: &str| -> Result<u64, String> {
            if s.is_empty() || s.len() > 18 || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("'{range}' is not a number or a range such as 1-4"));
            }
            s.parse().map_err(|_| format!("'{s}' is not a number"))
        };
        let (lo_text, hi_text) = range.split_once('-').unwrap_or((range, range));
        let (lo, hi) = (number(lo_text)?, number(hi_text)?);
        if lo > hi {
            return Err(format!("range '{range}' goes backwards"));
        }
        if out.len() as u64 + (hi - lo) >= MAX_HOSTS as u64 {
            return Err(format!("more than {MAX_HOSTS} names"));
        }
        let width = lo_text.len();
        out.extend((lo..=hi).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

fn product(pieces: &[Piece], prefix: &mut String, out: &mut Vec<String>) {
    let Some((first, rest)) = pieces.split_first() else {
        out.push(prefix.clone());
        return;
    };
    let len = prefix.len();
    match first {
        Piece::Text(t) => {
            prefix.push_str(t);
            product(rest, prefix, out);
        }
        Piece::Choices(choices) => {
            for choice in choices {
                prefix.push_str(choice);
                product(rest, prefix, out);
                prefix.truncate(len);
            }
        }
    }
    prefix.truncate(len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists_compress_as_slurm_writes_them() {
        assert_eq!(compress(&["gpu-01", "gpu-02", "gpu-03", "gpu-04"]), "gpu-[01-04]");
        assert_eq!(compress(&["gpu-01", "gpu-02", "gpu-03", "gpu-07"]), "gpu-[01-03,07]");
        assert_eq!(compress(&["node1"]), "node1");
        assert_eq!(compress(&["node1", "node3", "login"]), "node[1,3],login");
        // `scontrol show hostlist a9,a10` (Slurm 22.05) writes a[9-10]: unpadded numbers run on.
        assert_eq!(compress(&["a9", "a10"]), "a[9-10]");
        assert_eq!(compress::<&str>(&[]), "");
    }

    #[test]
    fn hostlists_expand_and_stay_bounded() {
        assert_eq!(expand("gpu-[01-03,07],login").unwrap(), ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "login"]);
        assert_eq!(expand("n[1-2]-ib").unwrap(), ["n1-ib", "n2-ib"]);
        let names = ["gpu-01", "gpu-02", "gpu-07", "x"];
        assert_eq!(expand(&compress(&names)).unwrap(), names);
        assert!(expand("n[1-999999999]").unwrap_err().to_string().contains("more than"));
        assert!(expand("n[3-1]").unwrap_err().to_string().contains("invalid hostlist"));
        assert!(expand("n[1-2").is_err());
    }

    fn names(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Pairs written down from `scontrol show hostlist` of Slurm 22.05.
    #[test]
    fn compresses_as_slurm_does() {
        let cases: &[(&str, &str)] = &[
            ("gpu-01,gpu-02,gpu-03,gpu-07,n1,n2,n3,a,b9,b10,b011", "gpu-[01-03,07],n[1-3],a,b[9-10,011]"),
            ("node1,node2,node10,node09,node3", "node[1-2,10,09,3]"),
            ("a1b1,a1b2,x,x,n001,n2", "a1b[1-2],x,x,n[001,2]"),
            ("n9,n10,n11", "n[9-11]"),
            ("h-1,h-2,h-3-x,10.0.0.1,10.0.0.2", "h-[1-2],h-3-x,10.0.0.[1-2]"),
            ("n1,m1,n2", "n1,m1,n2"),
            ("n3,n1,n2", "n[3,1-2]"),
            ("n1,n1,n2", "n[1,1-2]"),
            ("gpu01", "gpu01"),
            ("n01,n2,n03", "n[01,2,03]"),
            ("n9,n10,n08", "n[9-10,08]"),
            ("r1n01,r1n02,r2n01", "r1n[01-02],r2n01"),
            ("localhost", "localhost"),
            ("", ""),
        ];
        for (hosts, want) in cases {
            let hosts: Vec<&str> = if hosts.is_empty() { vec![] } else { hosts.split(',').collect() };
            assert_eq!(compress(&hosts), *want, "{hosts:?}");
        }
    }

    /// Lists as `scontrol show hostnames` of Slurm 22.05 expands them.
    #[test]
    fn expands_as_slurm_does() {
        assert_eq!(
            names("gpu-[01-03,7],n[1-2]c[1-2]"),
            ["gpu-01", "gpu-02", "gpu-03", "gpu-7", "n1c1", "n1c2", "n2c1", "n2c2"]
        );
        assert_eq!(names("n[08-11],m[9-10]"), ["n08", "n09", "n10", "n11", "m9", "m10"]);
        assert_eq!(names("a[1,3],b"), ["a1", "a3", "b"]);
        assert_eq!(names("r[1-2]n[01-02]"), ["r1n01", "r1n02", "r2n01", "r2n02"]);
        assert_eq!(
            names("n[1-3]-ib"),
            ["n1-ib", "n2-ib", "n3-ib"],
            "text after a group (Slurm 22.05 refuses it; corral reads it)"
        );
        assert_eq!(names(" login1 , login2 "), ["login1", "login2"]);
        assert!(names("").is_empty());
    }

    #[test]
    fn what_compress_writes_expands_to_the_same_names() {
        let hosts = ["gpu-01", "gpu-02", "gpu-10", "gpu-9", "x", "node007", "node008", "10.0.0.254", "10.0.0.255"];
        assert_eq!(names(&compress(&hosts)), hosts);
    }

    #[test]
    fn bad_lists_are_one_line_errors() {
        for (list, why) in [
            ("n[3-1]", "goes backwards"),
            ("n[1-", "without its ']'"),
            ("n1]", "without its '['"),
            ("n[[1]]", "inside brackets"),
            ("n[a-b]", "not a number"),
            ("n[1-100000]", "more than 65536"),
            ("n[0-999]x[0-999]", "more than 65536"),
        ] {
            let err = expand(list).expect_err(list).to_string();
            assert!(err.contains(why) && !err.contains('\n'), "{list}: {err}");
        }
    }
}
