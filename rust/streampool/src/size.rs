//! Sizes given as strings: "1GiB" is 2**30 bytes, "1GB" is 10**9.

use crate::error::{Error, Result};

/// Parses a byte size: a whole number of bytes ("4096"), or a number (a decimal fraction
/// allowed) followed by a unit.
///
/// * Binary units, powers of 1024: KiB, MiB, GiB, TiB, PiB, EiB, and the bare letters K,
///   M, G, T, P, E, which mean the same: "1G" and "1GiB" are both 2**30 bytes.
/// * Decimal units, powers of 1000: kB (or KB), MB, GB, TB, PB, EB: "1GB" is 10**9 bytes.
/// * "B" (or nothing) is bytes.
///
/// Units are case-insensitive and may follow the number after white space; `_` may group
/// digits ("1_000"). A fraction of a byte is dropped, as RMM's `parse_bytes` does
/// ("1.5" is 1 byte, "0.1KiB" is 102 bytes); the arithmetic is exact (no floating point),
/// to 19 decimal places.
///
/// ```
/// use streampool::parse_size;
/// assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
/// assert_eq!(parse_size("1G").unwrap(), 1 << 30);
/// assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
/// assert_eq!(parse_size("1.5 KiB").unwrap(), 1536);
/// assert_eq!(parse_size("1.5").unwrap(), 1);
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
    let (whole, fraction) = num.split_once('.').unwrap_or((&num, ""));
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
        return Err(bad());
    }
    let scale: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        "e" | "eib" => 1 << 60,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "eb" => 1_000_000_000_000_000_000,
        _ => return Err(bad()),
    };
    let too_large = || Error::invalid(format!("size {text:?} is too large"));
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| too_large())? };
    // The fraction as digits / 10^n, n <= 19: the product with the largest scale (2**60)
    // stays below 2**128.
    let fraction = &fraction[..fraction.len().min(19)];
    let part = if fraction.is_empty() {
        0
    } else {
        let digits: u128 = fraction.parse().map_err(|_| bad())?;
        digits * scale / 10u128.pow(fraction.len() as u32)
    };
    let bytes = whole.checked_mul(scale).and_then(|b| b.checked_add(part)).ok_or_else(too_large)?;
    usize::try_from(bytes).map_err(|_| too_large())
}

/// Rounds `bytes` up to a multiple of `align` (a power of two), for sizes the crate has
/// already bounded (below `isize::MAX`).
pub(crate) const fn align_up(bytes: usize, align: usize) -> usize {
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
        assert_eq!(parse_size("1PiB").unwrap(), 1 << 50);
        assert_eq!(parse_size("2 EiB").unwrap(), 2 << 60);
        assert_eq!(parse_size("1P").unwrap(), 1 << 50);
        assert_eq!(parse_size("3pb").unwrap(), 3_000_000_000_000_000);
        assert_eq!(parse_size("1EB").unwrap(), 1_000_000_000_000_000_000);
        assert_eq!(parse_size("1G").unwrap(), parse_size("1GiB").unwrap());
        assert_eq!(parse_size(".5KiB").unwrap(), 512);
        assert_eq!(parse_size("5.").unwrap(), 5);
    }

    #[test]
    fn fractions_of_a_byte_are_dropped() {
        assert_eq!(parse_size("1.5").unwrap(), 1);
        assert_eq!(parse_size("0.9").unwrap(), 0);
        assert_eq!(parse_size("0.1KiB").unwrap(), 102); // 102.4
        assert_eq!(parse_size("1.9999KB").unwrap(), 1999); // 1999.9
                                                           // Exact where floating point is not: 4.35 * 10**6 is 4349999.999... as an f64.
        assert_eq!(parse_size("4.35MB").unwrap(), 4_350_000);
        assert_eq!(parse_size("0.000000000000000001EiB").unwrap(), 1); // 1.15 bytes
        assert_eq!(parse_size("1.00000000000000000000000001").unwrap(), 1);
    }

    #[test]
    fn refuses() {
        for s in ["", "GiB", "-1", "1 parsec", "1.2.3MB", "ten"] {
            let e = parse_size(s).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{s}: {e}");
        }
        for s in [".", "_", "1..", "..5", "1.5.GiB"] {
            assert!(matches!(parse_size(s), Err(Error::InvalidArgument(_))), "{s}");
        }
        assert!(parse_size("99999999999999999999TiB").is_err());
        assert!(parse_size("16EiB").is_err()); // 2**64
        assert!(parse_size("999999999999999999999999999999999999999999").is_err());
    }
}
