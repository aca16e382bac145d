//! Sizes given as strings: "1GiB" is 2**30 bytes, "1GB" is 10**9.

use crate::error::{Error, Result};

/// Parses a byte size: a whole number of bytes ("4096"), or a number (fractions allowed)
/// followed by a unit. Binary units: KiB, MiB, GiB, TiB, and the bare K, M, G, T. Decimal
/// units: kB/KB, MB, GB, TB. "B" is bytes. Units are case-insensitive; white space
/// between number and unit is allowed. The result is rounded to the nearest byte.
///
/// ```
/// use streampool::parse_size;
/// assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
/// assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
/// assert_eq!(parse_size("1.5 KiB").unwrap(), 1536);
/// assert!(parse_size("-1MiB").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<usize> {
    let s = text.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let bad = || {
        Error::invalid(format!(
            "cannot parse {text:?} as a size; use bytes or a unit such as \"512MiB\", \"4GiB\" or \"1GB\""
        ))
    };
    let num = num.replace('_', "");
    if num.is_empty() {
        return Err(bad());
    }
    let scale: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    let bytes: u128 = if let Ok(whole) = num.parse::<u128>() {
        whole.checked_mul(scale).ok_or_else(bad)?
    } else {
        let f: f64 = num.parse().map_err(|_| bad())?;
        (f * scale as f64).round() as u128
    };
    usize::try_from(bytes).map_err(|_| Error::invalid(format!("size {text:?} is too large")))
}

/// Rounds `bytes` up to a multiple of `align` (a power of two).
pub const fn align_up(bytes: usize, align: usize) -> usize {
    (bytes + align - 1) & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1KiB").unwrap(), 1024);
        assert_eq!(parse_size("1kb").unwrap(), 1000);
        assert_eq!(parse_size("2 MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("3G").unwrap(), 3 << 30);
        assert_eq!(parse_size("1TB").unwrap(), 1_000_000_000_000);
        assert_eq!(parse_size("0.5GiB").unwrap(), 1 << 29);
        assert_eq!(parse_size("1_000").unwrap(), 1000);
    }

    #[test]
    fn refuses() {
        for s in ["", "GiB", "-1", "1 parsec", "1.2.3MB", "ten"] {
            let e = parse_size(s).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{s}: {e}");
        }
        assert!(parse_size("99999999999999999999TiB").is_err());
    }
}
